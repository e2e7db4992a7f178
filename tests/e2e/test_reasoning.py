"""Reasoning outputs on a real stack (2 unified engines, the proxy with `--reasoning-parser qwen3`), through the
official `openai` client. The tiny Qwen3 checkpoint has Qwen3's `<think>` tokens and thinking template but random
weights, so a structured output makes it write `<think>...</think>` and an answer: its reasoning comes back as
reasoning_content (and reasoning), the rest as content, whole and streamed, with logprobs for every token; tool
calls are read from the answer only; `enable_thinking: false` reaches the template and turns reasoning off;
completions are not parsed; and a stream whose engine is killed mid-reasoning continues on the other engine
with the same split."""
import signal
import threading
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

# Reasoning then an answer, as Qwen3 writes them.
THOUGHT = r"<think>\n[a-z ]{8,40}\n</think>\n\n[a-z ]{4,20}"
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}"\}\}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Which is larger, 9.11 or 9.8?"}]


@pytest.fixture(scope="module")
def stack(tiny_qwen3_thinking_path, stack_factory):
    return stack_factory(tiny_qwen3_thinking_path, unified=2, engine_args=["--num-kv-blocks", "512"],
                         proxy_args=["--reasoning-parser", "qwen3"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, regex: str | None = None, **kwargs):
    body = kwargs.pop("extra_body", {}) | ({"structured_outputs": {"regex": regex}} if regex else {})
    kwargs = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0} | kwargs
    return client.chat.completions.create(model="demo", extra_body=body, **kwargs)


def streamed(client, regex: str | None = None, on_event=lambda choices: None, **kwargs) -> dict:
    """choice index -> its reasoning, content, tool calls (name, arguments), logprob tokens and finish reason,
    put together from the stream's deltas as a client does (`on_event(choices)` after each event)."""
    choices: dict[int, dict] = {}
    for event in chat(client, regex, stream=True, **kwargs):
        for c in event.choices:
            out = choices.setdefault(c.index, {"reasoning": "", "content": "", "calls": {}, "tokens": [],
                                               "finish_reason": None})
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")  # both names, or neither
            out["reasoning"] += extra.get("reasoning_content") or ""
            out["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                name, arguments = out["calls"].get(call.index, ("", ""))
                out["calls"][call.index] = (name + (call.function.name or ""),
                                            arguments + (call.function.arguments or ""))
            out["tokens"] += [t.token for t in c.logprobs.content] if c.logprobs else []
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
        on_event(choices)
    return choices


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


@pytest.mark.parametrize("tags", ["in pieces", "as tokens"])
def test_reasoning_comes_apart_from_the_answer_with_a_logprob_per_token(client, tiny_qwen3_thinking_path, tags):
    """The random model writes the tags character by character ('<', 't', 'hin', 'k', '>': a stream's deltas
    split them); favoured by logit_bias, it writes each as its one token, as a trained Qwen3 does."""
    tag_ids = AutoTokenizer.from_pretrained(tiny_qwen3_thinking_path).convert_tokens_to_ids(["<think>", "</think>"])
    bias = {"logit_bias": {str(i): 100 for i in tag_ids}} if tags == "as tokens" else {}
    resp = chat(client, THOUGHT, logprobs=True, **bias)
    message, choice = resp.choices[0].message, resp.choices[0]
    reasoning = reasoning_of(message)
    assert reasoning.startswith("\n") and reasoning.endswith("\n") and len(reasoning.strip()) >= 8
    assert "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content.startswith("\n\n") and "think>" not in message.content and choice.finish_reason == "stop"
    # Every token the model wrote, the tags and the end of its turn included, has its logprob.
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == resp.usage.completion_tokens
    assert "".join(tokens) == f"<think>{reasoning}</think>{message.content}<|im_end|>"
    assert (tokens[0] == "<think>" and "</think>" in tokens) == (tags == "as tokens"), tokens

    stream = streamed(client, THOUGHT, logprobs=True, **bias)
    assert stream == {0: {"reasoning": reasoning, "content": message.content, "calls": {}, "tokens": tokens,
                          "finish_reason": "stop"}}


def test_each_of_n_choices_is_parsed_alone(client):
    kwargs = dict(n=3, temperature=1.0, seed=5)
    whole = chat(client, THOUGHT, **kwargs)
    answers = {c.index: (reasoning_of(c.message), c.message.content) for c in whole.choices}
    assert len(set(answers.values())) == 3
    assert all(r and "think>" not in r and c and "think>" not in c for r, c in answers.values())
    stream = streamed(client, THOUGHT, **kwargs)
    assert {i: (c["reasoning"], c["content"]) for i, c in stream.items()} == answers


def test_tool_calls_are_read_from_the_answer_only(client):
    regex = rf"<think>\nmaybe {CALL}\n</think>\n\n{CALL}"  # a call in the reasoning, then one in the answer
    resp = chat(client, regex, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert "<tool_call>" in reasoning_of(choice.message)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    stream = streamed(client, regex, tools=[WEATHER])[0]
    assert stream["reasoning"] == reasoning_of(choice.message) and not stream["content"].strip()
    assert stream["calls"] == {0: ("get_weather", choice.message.tool_calls[0].function.arguments)}
    assert stream["finish_reason"] == "tool_calls"

    # A call only in the reasoning is no call.
    resp = chat(client, rf"<think>\nmaybe {CALL}\n</think>\n\n[a-z ]{{4,20}}", tools=[WEATHER])
    assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
    assert "<tool_call>" in reasoning_of(resp.choices[0].message) and resp.choices[0].message.content


def test_enable_thinking_false_reaches_the_template_and_turns_reasoning_off(client, tiny_qwen3_thinking_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_thinking_path)
    closed_block = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    thinking = chat(client, max_tokens=8, extra_body={"ignore_eos": True})
    off = chat(client, max_tokens=8, extra_body={"ignore_eos": True,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == thinking.usage.prompt_tokens + closed_block
    # Unconstrained, the random model closes no block: thinking, all of it is reasoning; off, all is the answer.
    assert reasoning_of(thinking.choices[0].message) and thinking.choices[0].message.content is None
    assert reasoning_of(off.choices[0].message) is None and off.choices[0].message.content
    stream = streamed(client, max_tokens=8, extra_body={"ignore_eos": True,
                                                        "chat_template_kwargs": {"enable_thinking": False}})[0]
    assert (stream["reasoning"], stream["content"]) == ("", off.choices[0].message.content)
    # Even a <think> block it writes is the answer then.
    written = chat(client, THOUGHT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(written.choices[0].message) is None
    assert written.choices[0].message.content.startswith("<think>\n")


def test_include_reasoning_false_leaves_it_out(client):
    full = chat(client, THOUGHT).choices[0].message
    without = chat(client, THOUGHT, extra_body={"include_reasoning": False}).choices[0].message
    assert reasoning_of(without) is None and without.content == full.content
    stream = streamed(client, THOUGHT, extra_body={"include_reasoning": False})[0]
    assert (stream["reasoning"], stream["content"]) == ("", full.content)


def test_an_assistants_reasoning_in_the_history_reaches_the_template(client, tiny_qwen3_thinking_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_thinking_path)
    turn = {"role": "assistant", "content": "The first."}
    plain = chat(client, messages=[*MESSAGES, turn], max_tokens=1).usage.prompt_tokens
    # What the template renders for the turn with its reasoning (after the last user message: Qwen3 drops it
    # from earlier turns).
    prompt = tokenizer.apply_chat_template([*MESSAGES, turn | {"reasoning_content": "Compare the tenths."}],
                                           add_generation_prompt=True, tokenize=False)
    assert "<think>\nCompare the tenths.\n</think>\n\nThe first." in prompt
    for field in ("reasoning_content", "reasoning"):  # either name reaches it
        history = [*MESSAGES, turn | {field: "Compare the tenths."}]
        assert chat(client, messages=history, max_tokens=1).usage.prompt_tokens == \
            len(tokenizer.encode(prompt, add_special_tokens=False)) > plain


def test_completions_are_not_parsed(client):
    resp = client.completions.create(model="demo", prompt="Think first.", max_tokens=200, temperature=0,
                                     extra_body={"structured_outputs": {"regex": THOUGHT}})
    assert resp.choices[0].text.startswith("<think>\n") and "</think>" in resp.choices[0].text
    assert "reasoning_content" not in (resp.choices[0].model_extra or {})


def test_a_stream_killed_mid_reasoning_continues_elsewhere_with_the_same_split(stack, client):
    """The engine streaming a long reasoning is frozen once the client has part of it, then killed: the proxy
    continues the stream on the other engine from the tokens delivered, and the parser, which lives in the
    proxy, goes on where it was: the client gets the same reasoning and answer as without the fault."""
    regex = r"<think>\n[a-z ]{1200,1300}\n</think>\n\n[a-z ]{100,200}"
    kwargs = dict(max_tokens=1900, logprobs=True)
    expected = streamed(client, regex, **kwargs)[0]
    assert len(expected["tokens"]) > 200 and expected["content"] and expected["finish_reason"] == "stop"
    proxy = stack.services["proxy"]
    migrations = proxy.metrics().get("epdserve:request_migrations_total", 0.0)

    got: dict = {}
    progress = {"reasoning": ""}
    started = threading.Event()

    def watch(choices):
        progress["reasoning"] = choices.get(0, {}).get("reasoning", "")
        if len(progress["reasoning"]) >= 40:
            started.set()

    consumer = threading.Thread(target=lambda: got.update(streamed(client, regex, watch, **kwargs)))
    consumer.start()
    assert started.wait(120), "no reasoning streamed"
    running = [s for name, s in stack.services.items()
               if name.startswith("unified") and s.metrics().get("vllm:num_requests_running", 0) >= 1]
    assert len(running) == 1, "the stream is not running on exactly one engine"
    running[0].proc.send_signal(signal.SIGSTOP)  # frozen mid-reasoning: nothing more reaches the client
    frozen = consumer.is_alive(), len(progress["reasoning"])
    running[0].stop(signal.SIGKILL)
    assert frozen[0] and frozen[1] < len(expected["reasoning"]), "the stream ended before its engine was lost"
    consumer.join(300)
    assert not consumer.is_alive()
    assert got == {0: expected}
    assert proxy.metrics()["epdserve:request_migrations_total"] == migrations + 1
    running[0].start()  # as a restart policy would: the stack heals
    deadline = time.monotonic() + 120
    while httpx.get(stack.url + "/ready", timeout=5).json()["healthy_instances"].get("unified") != 2:
        assert time.monotonic() < deadline, "the killed engine did not come back"
        time.sleep(0.2)
