"""Logprobs that are not finite numbers (a model whose weights went bad: every logit NaN) never make a response
invalid JSON: the proxy's OpenAI layer answers them as vLLM's floor, -9999.0, streamed or not, for completions
and chat, the sampled token's, its top alternatives and the prompt's. A real engine serves a real checkpoint
here, with one weight of its final norm set to NaN after loading."""
import json
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from epdserve import AsyncLLM
from epdserve.services.batch.engine_backend import EngineBackend
from epdserve.services.cli.launcher import free_port
from epdserve.services.proxy.app import build_app
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.prompt_logprobs import LOGPROB_FLOOR
from epdserve.services.proxy.serving import OpenAIServing

MODEL = "tiny"


@pytest.fixture(scope="module")
def url(tiny_model_paths):
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_engine_config(tiny_model_paths["llama"], num_kv_blocks=64, max_model_len=256),
                       detokenize=False)
    norm = next(p for name, p in engine.runner.model.named_parameters() if name == "norm.weight"
                or name.endswith(".norm.weight") and "layers" not in name)
    with torch.no_grad():
        norm[0] = float("nan")  # the last hidden state's first feature, so every logit
    llm = AsyncLLM(engine)
    metrics = ProxyMetrics(MODEL)
    serving = OpenAIServing(MODEL, engine.tokenizer, EngineBackend(llm), engine.model_config.max_model_len,
                            engine.model_config.vocab_size, metrics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(serving, metrics), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    llm.shutdown()


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are not numbers there."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def logprob_values(node) -> list[float]:
    """Every logprob in a body: each number under a `logprob` key (chat, prompt_logprobs), in a completion's
    `token_logprobs`, and in its `top_logprobs` ({token: logprob} per token)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "logprob":
                found.append(value)
            elif key == "token_logprobs":
                found += [v for v in value if v is not None]
            elif key == "top_logprobs" and any(isinstance(e, dict) and "logprob" not in e for e in value):
                found += [v for entry in value if entry for v in entry.values()]
            else:
                found += logprob_values(value)
    elif isinstance(node, list):
        for item in node:
            found += logprob_values(item)
    return found


def post(url: str, route: str, body: dict) -> list:
    """The response's JSON bodies (one per event when streamed), each parsed strictly."""
    r = httpx.post(url + route, json={"model": MODEL, "max_tokens": 3, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return [strict_json(r.text)]
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [strict_json(event) for event in events[:-1]]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_of_nan_logits_are_the_floor(url, stream):
    bodies = post(url, "/v1/completions", {"prompt": "Once upon a time", "logprobs": 2, "echo": True,
                                           "stream": stream})
    values = logprob_values(bodies)
    assert len(values) >= 3 * 3 and set(values) == {LOGPROB_FLOOR}, values


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_of_nan_logits_are_the_floor(url, stream):
    bodies = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                                "top_logprobs": 2, "stream": stream})
    values = logprob_values(bodies)
    assert len(values) >= 3 * 3 and set(values) == {LOGPROB_FLOOR}, values


def test_prompt_logprobs_of_nan_logits_are_the_floor(url):
    [body] = post(url, "/v1/completions", {"prompt": "Once upon a time", "prompt_logprobs": 1})
    values = [entry["logprob"] for position in body["choices"][0]["prompt_logprobs"] or body["prompt_logprobs"]
              if position for entry in position.values()]
    assert values and set(values) == {LOGPROB_FLOOR}, values
