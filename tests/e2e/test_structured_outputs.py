"""Structured outputs and forced tool calls on real stacks, through the official `openai` client: unified,
1 prefill + 1 decode (prefill samples the first token under the grammar, decode the rest on the pulled KV),
1 prefill + 1 decode whose KV pull always fails (a lease shorter than the handoff), so decode
recomputes the prompt and replays prefill's first token into its own matcher, and 1 encoder + 1 prefill
+ 1 decode on the demo model, where the JSON answers are about an image."""
import base64
import io
import json

import jsonschema
import numpy as np
import openai
import pytest
from PIL import Image

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "job": {"type": "string", "enum": ["pirate", "baker", "pilot"]}},
          "required": ["name", "age", "job"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                                        "required": ["hour"], "additionalProperties": False}}}

# Load routing on the disaggregated stacks: every request takes the prefill -> decode handoff these tests
# are about (KV-aware routing would let the decode that holds a repeated prompt prefill it itself).
HANDOFF = ["--routing-policy", "load"]
STACKS = {
    "unified": dict(unified=1),
    "prefill-decode": dict(prefills=1, decodes=1, proxy_args=HANDOFF),
    # The lease ends before decode can pull: every request falls back to recomputing on decode.
    "prefill-decode-recompute": dict(prefills=1, decodes=1, engine_args=["--lease-seconds", "0.001"],
                                     proxy_args=HANDOFF),
    # The demo model (SmolLM2 behind a vision tower): constrained answers about an image.
    "encoder-prefill-decode": dict(encoders=1, prefills=1, decodes=1, proxy_args=HANDOFF),
}


def picture_url() -> str:
    y, x = np.mgrid[0:64, 0:96] / 96
    rgb = np.stack([np.sin(x * (3 + c)) * np.cos(y * 5) for c in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(((rgb + 1) * 127.5).astype(np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request, default_model_path, demo_model, stack_factory):
    """One stack at a time: each is stopped before the next starts (a machine holds few SmolLM2 engines)."""
    model = demo_model if STACKS[request.param].get("encoders") else default_model_path
    started = stack_factory(model, **STACKS[request.param])
    started.name = request.param
    yield started
    started.stop()
    stack_factory.started.remove(started)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def decode_recomputes(stack) -> float:
    decode = stack.services.get("decode-0")
    return decode.metrics().get("epdserve:local_prefills_total", 0.0) if decode else 0.0


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 4)])
def test_json_schema_answer_validates(stack, client, temperature, seed):
    before = decode_recomputes(stack)
    ask = "Invent a character and describe them as JSON."
    content = ask if "encoder-0" not in stack.services else [
        {"type": "image_url", "image_url": {"url": picture_url()}}, {"type": "text", "text": ask}]
    resp = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": content}],
        max_tokens=80, temperature=temperature, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA,
                                                                "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    if stack.name == "prefill-decode-recompute":
        assert decode_recomputes(stack) > before  # the fallback ran
    elif stack.name in ("prefill-decode", "encoder-prefill-decode"):
        assert decode_recomputes(stack) == before  # pulled, not recomputed


def test_regex_and_choice(stack, client):
    regex = client.completions.create(model="demo", prompt="A licence plate:", max_tokens=12, temperature=1.0,
                                      extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    text = regex.choices[0].text
    assert len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit()
    choice = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Red or blue?"}],
                                            max_tokens=5, temperature=1.0,
                                            extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert choice.choices[0].message.content in ("red", "blue")


def test_forced_tool_calls_parse_with_the_client_types(stack, client):
    ask = [{"role": "user", "content": "Will it rain in Lisbon this week?"}]
    named = client.chat.completions.create(model="demo", messages=ask, tools=[WEATHER, ALARM], temperature=0,
                                           max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    required = client.chat.completions.create(model="demo", messages=ask, tools=[WEATHER, ALARM], temperature=1.0,
                                              seed=2, max_tokens=150, tool_choice="required",
                                              parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALARM)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    arguments = ""
    for event in client.chat.completions.create(model="demo", messages=ask, tools=[WEATHER], temperature=0,
                                                max_tokens=60, stream=True, tool_choice={
                                                    "type": "function", "function": {"name": "get_weather"}}):
        for tc in (event.choices[0].delta.tool_calls or ()) if event.choices else ():
            arguments += tc.function.arguments or ""
    assert json.loads(arguments) == json.loads(call_arguments(named))


def call_arguments(response) -> str:
    return response.choices[0].message.tool_calls[0].function.arguments


def test_bad_schema_is_a_400_and_the_stack_keeps_serving(stack, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "minProperties": "two"}}})
    assert info.value.body.get("param") == "response_format"
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):  # refused by the engine
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body={"guided_grammar": "root ::= missing"})
    ok = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")
