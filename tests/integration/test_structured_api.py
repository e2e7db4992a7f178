"""Structured outputs, tools and logit_bias through the proxy's OpenAI layer, over real HTTP to the official
`openai` client, with SmolLM2 in an engine in the same process (the multi-process stacks: tests/e2e)."""
import json
import re
import socket
import threading
import time

import jsonschema
import openai
import pytest
import uvicorn

from epdserve import AsyncLLM
from epdserve.services.proxy.app import build_app
from epdserve.services.batch.engine_backend import EngineBackend
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

MODEL = "smollm2"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model_path):
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_engine_config(default_model_path, num_kv_blocks=128), detokenize=False)
    llm = AsyncLLM(engine)
    metrics = ProxyMetrics(MODEL)
    serving = OpenAIServing(MODEL, engine.tokenizer, EngineBackend(llm), engine.model_config.max_model_len,
                            engine.model_config.vocab_size, metrics)
    app = build_app(serving, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(10)
    llm.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"max_tokens": 80, **kwargs})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_validates(client, temperature):
    resp = chat(client, messages=[{"role": "user", "content": "Tell me about a big city, as JSON."}],
                temperature=temperature, seed=3, response_format={
                    "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_regex_choice_and_grammar(client):
    obj = chat(client, messages=ASK, temperature=0, response_format={"type": "json_object"}, max_tokens=100)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert obj.choices[0].message.content.lstrip().startswith("{")
    regex = client.completions.create(model=MODEL, prompt="The year the war ended:", max_tokens=10, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert regex.choices[0].text.isdigit() and len(regex.choices[0].text) == 4
    old = client.completions.create(model=MODEL, prompt="My phone code:", max_tokens=10, temperature=1.0,
                                    extra_body={"guided_regex": "[a-c]{2}-[0-9]{2}"})
    assert len(old.choices[0].text) == 5 and old.choices[0].text[2] == "-"
    choice = chat(client, messages=[{"role": "user", "content": "Is the sky green?"}], temperature=1.0,
                  extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert choice.choices[0].message.content in ("yes", "no", "it depends")
    grammar = chat(client, messages=[{"role": "user", "content": "Count."}], temperature=0,
                   extra_body={"structured_outputs": {"grammar": 'root ::= "one, " ("two" | "three") (", " num)?\n'
                                                                 'num ::= [0-9] [0-9]?'}})
    assert grammar.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"one, (two|three)(, [0-9]{1,2})?", grammar.choices[0].message.content)


def test_named_tool_choice_is_a_valid_call(client):
    resp = chat(client, messages=ASK, temperature=0, tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_of_the_tools(client, parallel):
    resp = chat(client, messages=ASK, temperature=1.0, seed=5, tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=parallel, max_tokens=150)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _stream_calls(stream) -> tuple[str, dict, str]:
    content, calls, finish = "", {}, None
    for event in stream:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                assert entry["name"] is None and entry["arguments"] == "", "the name comes first, once"
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = event.choices[0].finish_reason or finish
    return content, calls, finish


def test_streamed_named_call_reassembles_to_the_same_call(client):
    kwargs = dict(messages=ASK, temperature=0, tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(client, **kwargs).choices[0].message.tool_calls[0]
    _, calls, finish = _stream_calls(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


# With tool_choice auto the model is free; a regex holds this small model to the Hermes format, so the
# parser reads a real output (recorded outputs of other shapes are in tests/unit/test_tool_parsers.py).
HERMES = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", ' \
         r'"unit": "celsius"\}\}\n</tool_call>'


def test_auto_tool_calls_are_parsed_streamed_or_not(client):
    kwargs = dict(messages=ASK, temperature=0, tools=[WEATHER], tool_choice="auto",
                  extra_body={"structured_outputs": {"regex": HERMES}})
    message = chat(client, **kwargs).choices[0].message
    (call,) = message.tool_calls
    assert message.content == "Let me check." and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] == "celsius" and arguments["city"] in ("Paris", "Lyon")
    content, calls, finish = _stream_calls(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == arguments
    assert calls[0]["id"].startswith("call_")


def test_tool_call_history_is_accepted_and_rendered(client, server):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    resp = chat(client, messages=messages, tools=[WEATHER], temperature=0, max_tokens=20)
    assert resp.choices[0].message.role == "assistant"
    import httpx

    tokens = httpx.post(server[0] + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    prompt = server[1].tokenizer.decode(tokens, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and '{"temperature": 21}' in prompt


def test_logit_bias_steers_greedy_output(client, server):
    tokenizer = server[1].tokenizer
    base = chat(client, messages=ASK, temperature=0, max_tokens=3, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True})
    first = int(base.choices[0].logprobs.content[0].token.removeprefix("token_id:"))
    banned = chat(client, messages=ASK, temperature=0, max_tokens=3, logprobs=True, logit_bias={str(first): -100},
                  extra_body={"return_tokens_as_token_ids": True})
    assert int(banned.choices[0].logprobs.content[0].token.removeprefix("token_id:")) != first
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 3)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"12": 150}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    # Over the limits (256 KiB of constraint, 1024 logit_bias entries by default): refused before any check
    # or compile that would cost seconds, and before the wire could drop them.
    ({"logit_bias": {str(i): -1 for i in range(1025)}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "description": "x" * (300 << 10)}}}}, "response_format"),
    ({"guided_regex": "a" * (300 << 10)}, "guided_regex"),
    ({"guided_choice": ["word"] * (60 << 10)}, "guided_choice"),
    ({"structured_outputs": {"grammar": 'root ::= "' + "a" * (300 << 10) + '"'}}, "structured_outputs"),
])
def test_bad_constraints_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=ASK, extra_body=body)
    error = info.value.body
    assert info.value.status_code == 400
    assert error.get("param") == param or param in error.get("message", ""), error


def test_a_grammar_only_the_engine_can_refuse_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):
        chat(client, messages=ASK, extra_body={"guided_grammar": "root ::= undefined_rule"})
    with pytest.raises(openai.BadRequestError, match="no token of this model's vocabulary can begin"):
        chat(client, messages=ASK, extra_body={"guided_grammar": r"root ::= [^\x00-\U0010FFFF]"})
    assert chat(client, messages=ASK, max_tokens=2).choices[0].finish_reason == "length"  # still serving
