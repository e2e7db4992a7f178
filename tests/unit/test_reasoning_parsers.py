"""Reasoning read out of `<think>` outputs (deepseek_r1, qwen3), whole and streamed split at every point, and the
chat answers built from it: reasoning apart, tool calls parsed from the content only, logprobs untouched."""
import json

import pytest

from epdserve.services.proxy.chat_tools import ChatAnswer
from epdserve.services.proxy.openai_protocol import ChatCompletionRequest, ChatMessage
from epdserve.services.proxy.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'

# (output, reasoning, content) as a response whose output starts inside the reasoning reads it: the template
# opened the block (R1's) or the model opens it itself (Qwen3's).
OPEN = [
    ("<think>\nFirst, the capital.\n</think>\n\nParis.", "\nFirst, the capital.\n", "\n\nParis."),
    ("The template opened it.</think>Answer.", "The template opened it.", "Answer."),
    ("<think>cut short by max_tokens", "cut short by max_tokens", None),  # only the opening tag
    ("no tags at all", "no tags at all", None),
    ("<think>thought</think>", "thought", None),  # nothing after the closing tag
    ("</think>only an answer", None, "only an answer"),
    ("<think></think>", None, None),
    ("", None, None),
    ("a<think>b</think>c", "ab", "c"),  # an opening tag after some text: the tag alone goes
    ("a<think>b<think>c</think>d<think>e</think>", "ab<think>c", "d<think>e</think>"),  # only the first of each
    ("<think>x < y and y </ z, <thin</think>then</think>", "x < y and y </ z, <thin", "then</think>"),
    ("<think>日本語で考える 🤔 déjà vu</think>réponse ✓ 答え", "日本語で考える 🤔 déjà vu", "réponse ✓ 答え"),
    (f"<think>calling {CALL}</think>{CALL}", f"calling {CALL}", CALL),
]
# The same outputs when the response is constrained from its first token: the answer unless it opens the block.
CONSTRAINED = [
    ("<think>plan</think>answer", "plan", "answer"),
    ("<think>cut", "cut", None),
    ('{"name": "x"}', None, '{"name": "x"}'),
    ("plan</think>answer", None, "plan</think>answer"),
    (" <think>a</think>b", None, " <think>a</think>b"),  # not at the very start
    ("<thin", None, "<thin"),
    ("<", None, "<"),
    ("", None, None),
]
# Thinking switched off (Qwen3's enable_thinking: false): no parsing at all.
NOT_THINKING = [("<think>a</think>b", None, "<think>a</think>b"), ("plain", None, "plain"), ("", None, None)]

CASES = ([("deepseek_r1", None, False, *case) for case in OPEN]
         + [("qwen3", thinking, False, *case) for case in OPEN for thinking in (None, True)]
         + [(name, None, True, *case) for case in CONSTRAINED for name in REASONING_PARSERS]
         + [("deepseek_r1", False, False, *case) for case in OPEN[:3]]  # R1's template has no such switch
         + [("qwen3", False, constrained, *case) for case in NOT_THINKING for constrained in (False, True)])


def parser(name, thinking, constrained):
    return get_reasoning_parser(name, thinking, constrained)


@pytest.mark.parametrize("name, thinking, constrained, text, reasoning, content", CASES)
def test_whole_outputs(name, thinking, constrained, text, reasoning, content):
    assert parser(name, thinking, constrained).parse(text) == (reasoning, content)


def streamed(p, pieces: list[str]) -> tuple[str, str]:
    """Feed the output as a stream of `pieces`; what the client puts together."""
    reasoning, content, text = "", "", ""
    for i, piece in enumerate(pieces):
        text += piece
        r, c = p.parse_delta(text, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name, thinking, constrained, text, reasoning, content", CASES)
def test_every_split_of_a_stream_gives_the_whole_outputs_answer(name, thinking, constrained, text, reasoning, content):
    expected = (reasoning or "", content or "")
    for i in range(len(text) + 1):
        assert streamed(parser(name, thinking, constrained), [text[:i], text[i:]]) == expected, f"split at {i}"
    for i in range(len(text) + 1):  # a delta that adds nothing, then the rest one character at a time
        pieces = [text[:i], ""] + list(text[i:])
        assert streamed(parser(name, thinking, constrained), pieces) == expected, f"by characters from {i}"
    # Three deltas split at every pair of points.
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert streamed(parser(name, thinking, constrained), pieces) == expected, f"splits at {i}, {j}"


def test_a_tail_that_may_begin_a_tag_waits_until_it_is_known():
    p = get_reasoning_parser("deepseek_r1")
    assert p.parse_delta("<thi", False) == ("", "")
    assert p.parse_delta("<think>step </th", False) == ("step ", "")
    assert p.parse_delta("<think>step </thumb", False) == ("</thumb", "")
    assert p.parse_delta("<think>step </thumb </", False) == (" ", "")
    assert p.parse_delta("<think>step </thumb </think>ans", False) == ("", "ans")
    assert p.parse_delta("<think>step </thumb </think>answer </", False) == ("", "wer </")  # no more tags
    assert p.parse_delta("<think>step </thumb </think>answer </", True) == ("", "")

    constrained = get_reasoning_parser("qwen3", constrained=True)
    assert constrained.parse_delta("<th", False) == ("", "")
    assert constrained.parse_delta('<th{"', False) == ("", '<th{"')


def test_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("granite")


def answer_of(mode=None, include=True):
    """A choice's answer under deepseek_r1."""
    return ChatAnswer(mode, reasoning=get_reasoning_parser("deepseek_r1"), include_reasoning=include)


def test_the_message_carries_the_reasoning_under_both_names():
    message, reason = answer_of().message("<think>Two and two.</think>Four.", "stop")
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two.",
                       "reasoning": "Two and two."}
    assert reason == "stop"
    cut, reason = answer_of().message("<think>Two and", "length")
    assert cut == {"role": "assistant", "content": None, "reasoning_content": "Two and", "reasoning": "Two and"}
    hidden, _ = answer_of(include=False).message("<think>Two and two.</think>Four.", "stop")
    assert hidden == {"role": "assistant", "content": "Four.", "reasoning_content": None, "reasoning": None}


def test_without_a_reasoning_parser_the_text_is_the_answer():
    answer = ChatAnswer(None)
    assert answer.message("<think>a</think>b", "stop")[0] == {"role": "assistant", "content": "<think>a</think>b"}
    assert ChatAnswer(None).delta("<think>a</think>b", True) == {"content": "<think>a</think>b"}


def stream_answer(answer: ChatAnswer, text: str, step: int) -> tuple[str, str, dict, set]:
    """Stream `text` in pieces of `step` characters through `answer`: reasoning, content and calls as a client
    puts them together, and which reasoning keys the deltas used."""
    reasoning, content, calls, keys = "", "", {}, set()
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = answer.delta(text[:end], end == len(text))
        keys |= {k for k in delta if k.startswith("reasoning")}
        assert delta.get("reasoning_content") == delta.get("reasoning")
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", []):
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            entry["name"] = d["function"].get("name", entry["name"])
            entry["arguments"] += d["function"]["arguments"]
    return reasoning, content, {i: (c["name"], json.loads(c["arguments"])) for i, c in calls.items()}, keys


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_tool_calls_are_read_from_the_content_only(step):
    text = f"<think>I could write {CALL} here, but</think>\n{CALL}"
    message, reason = answer_of(mode="auto").message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == f"I could write {CALL} here, but"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Oslo"})]
    answer = answer_of(mode="auto")
    reasoning, content, calls, keys = stream_answer(answer, text, step)
    assert reasoning == message["reasoning_content"] and content.strip() == ""
    assert calls == {0: ("get_weather", {"city": "Oslo"})} and answer.finish_reason("stop") == "tool_calls"
    assert keys == {"reasoning_content", "reasoning"}

    only_thought = f"<think>{CALL}</think>No call after all."
    message, reason = answer_of(mode="auto").message(only_thought, "stop")
    assert reason == "stop" and "tool_calls" not in message and message["content"] == "No call after all."
    answer = answer_of(mode="auto")
    assert stream_answer(answer, only_thought, step)[:3] == (CALL, "No call after all.", {})
    assert answer.finish_reason("stop") == "stop"


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_answers_equal_the_whole_message(step):
    text = "<think>Thinking about ünïcödé 🤔</think>The answer </th is 42."
    whole, _ = answer_of().message(text, "stop")
    reasoning, content, _, _ = stream_answer(answer_of(), text, step)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert stream_answer(answer_of(include=False), text, step)[:2] == ("", whole["content"])
    assert stream_answer(answer_of(include=False), text, step)[3] == set()


def test_a_forced_call_is_the_answer():
    answer = ChatAnswer("named", function_name="f", reasoning=get_reasoning_parser("deepseek_r1", constrained=True))
    message, reason = answer.message('{"x": 1}', "stop")
    assert reason == "tool_calls" and message["reasoning_content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_history_reasoning_reaches_the_template_under_both_names():
    for field in ("reasoning_content", "reasoning"):
        message = ChatMessage(role="assistant", content="Four.", **{field: "Two and two."})
        assert message.model_dump(exclude_none=True) == {"role": "assistant", "content": "Four.",
                                                         "reasoning_content": "Two and two.",
                                                         "reasoning": "Two and two."}


def test_include_reasoning_defaults_to_true():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    assert request.include_reasoning and request.unknown_fields == []
    assert not ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], include_reasoning=False
                                     ).include_reasoning
