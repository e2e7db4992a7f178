"""Tool calls read from model outputs (Hermes format), whole and streamed, the answers built for each
tool_choice, and tools / tool-call history in the prompt of a template that does not render tools."""
import json

import pytest

from epdserve.services.proxy.chat_tools import ChatAnswer
from epdserve.services.proxy.tool_parsers import HermesToolParser, get_tool_parser
from epdserve.shared.processing.tool_prompt import messages_for_tool_template, messages_with_inline_tools

# Outputs as Hermes-format models (Qwen2.5, Hermes 2/3) write them.
ONE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
NO_CALL = "The weather in Paris is mild, about 20 degrees."
BROKEN = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
UNCLOSED = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
STRING_ARGS = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'


def calls_of(text):
    parsed = HermesToolParser().parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_recorded_outputs_parse():
    assert calls_of(ONE_CALL) == (None, [("get_weather", {"city": "Paris", "unit": "celsius"})])
    assert calls_of(TWO_CALLS) == ("I will look both up.", [("get_weather", {"city": "Oslo"}),
                                                            ("get_time", {"zone": "CET"})])
    assert calls_of(NO_CALL) == (NO_CALL, [])
    assert calls_of(BROKEN) == (BROKEN, [])  # not JSON: left as text, never a made-up call
    assert calls_of(UNCLOSED) == ("Checking.", [("get_time", {"zone": "UTC"})])  # cut before its end tag
    assert calls_of(STRING_ARGS) == (None, [("f", {"x": 1})])
    ids = [c.id for c in HermesToolParser().parse(TWO_CALLS).tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def stream(text: str, step: int):
    """Feed `text` in pieces of `step` characters; reassemble content and calls as a client does."""
    parser = get_tool_parser("hermes")
    content, calls = "", {}
    for end in list(range(step, len(text), step)) + [len(text)]:
        piece, deltas = parser.parse_delta(text[:end], end == len(text))
        content += piece
        for d in deltas:
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None and d["function"]["arguments"] == "", "name first, with the id"
                entry["name"] = d["function"]["name"]
            else:
                assert entry["name"] is not None, "arguments after the name"
                entry["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS, NO_CALL, UNCLOSED])
@pytest.mark.parametrize("step", [1, 3, 17, 1000])
def test_streamed_deltas_reassemble_to_the_parsed_calls(text, step):
    content, calls = stream(text, step)
    expected_content, expected_calls = calls_of(text)
    assert calls == expected_calls
    assert content.strip() == (expected_content or "")


def test_a_partial_start_tag_is_held_back_until_it_is_known():
    parser = HermesToolParser()
    assert parser.parse_delta("Hello <tool", False) == ("Hello ", [])
    assert parser.parse_delta("Hello <tooth", False) == ("<tooth", [])


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_answers_for_each_tool_choice():
    auto = ChatAnswer("auto")
    message, reason = auto.message(TWO_CALLS, "stop")
    assert reason == "tool_calls" and message["content"] == "I will look both up."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert ChatAnswer("auto").message(TWO_CALLS, "length")[1] == "length"
    single, _ = ChatAnswer("auto", parallel=False).message(TWO_CALLS, "stop")
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_weather"]
    streamed = ChatAnswer("auto", parallel=False).delta(TWO_CALLS, True)
    assert {c["index"] for c in streamed["tool_calls"]} == {0}
    assert ChatAnswer(None).message(ONE_CALL, "stop") == ({"role": "assistant", "content": ONE_CALL}, "stop")

    named, reason = ChatAnswer("named", function_name="get_weather").message('{"city": "Rome"}', "stop")
    assert reason == "tool_calls" and named["content"] is None
    assert named["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}

    required, _ = ChatAnswer("required").message('[{"name": "a", "parameters": {"x": 1}}, '
                                                 '{"name": "b", "parameters": {}}]', "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in required["tool_calls"]] == \
        [("a", {"x": 1}), ("b", {})]
    cut, reason = ChatAnswer("required").message('[{"name": "a", "param', "length")
    assert "tool_calls" not in cut and reason == "length"


def test_streamed_named_call_sends_the_name_then_the_argument_text():
    answer = ChatAnswer("named", function_name="f")
    first = answer.delta('{"x"', False)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first["tool_calls"][1]["function"] == {"arguments": '{"x"'}
    assert answer.delta('{"x": 1}', True) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert answer.finish_reason("stop") == "tool_calls"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_a_template_without_tools_gets_them_written_into_the_turns():
    out = messages_with_inline_tools(HISTORY, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert "<tools>" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                 '</tool_call>')
    assert out[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'
    assert HermesToolParser().parse(out[2]["content"]).tool_calls[0].name == "get_weather"  # reads back


def test_a_template_with_tools_gets_arguments_as_objects():
    out = messages_for_tool_template(HISTORY)
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def test_smollm2_template_renders_tools_and_history(default_model_path):
    from epdserve.shared.processing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    text = tokenizer.apply_chat_template(HISTORY, tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tool_response>\n{\"temp\": 21}" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(HISTORY[:2])
    assert "<tools>" not in plain  # no tools, no tool prompt
