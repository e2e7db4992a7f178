"""The proxy's OpenAI layer, served over real HTTP to the official `openai` client, with a real engine
behind it in the same process (the multi-process stack is tested in tests/e2e)."""
import asyncio
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from epdserve import AsyncLLM
from epdserve.services.cli.launcher import free_port
from epdserve.services.proxy.app import build_app
from epdserve.services.batch.engine_backend import EngineBackend
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing

MODEL = "tiny"



@pytest.fixture(scope="module")
def server(tiny_model_paths):
    from epdserve.shared.engine.llm_engine import LLMEngine
    from epdserve.shared.engine.llm import build_engine_config

    path = tiny_model_paths["llama"]
    engine = LLMEngine(build_engine_config(path, num_kv_blocks=256, max_model_len=512), detokenize=False)
    llm = AsyncLLM(engine)
    metrics = ProxyMetrics(MODEL)
    serving = OpenAIServing(MODEL, engine.tokenizer, EngineBackend(llm), engine.model_config.max_model_len,
                            engine.model_config.vocab_size, metrics)
    app = build_app(serving, metrics, api_key="secret")
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(100):
        if srv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", llm, engine
    srv.should_exit = True
    thread.join(10)
    llm.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="secret", max_retries=0)




def test_completion_matches_offline_engine(client, server, tiny_model_paths):
    from epdserve import LLM, SamplingParams

    resp = client.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=8, temperature=0)
    offline = LLM(model=tiny_model_paths["llama"], num_kv_blocks=64).generate(
        "The lighthouse keeper", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert resp.choices[0].text == offline.text
    assert resp.choices[0].finish_reason == offline.finish_reason
    assert resp.usage.completion_tokens == len(offline.token_ids)
    assert resp.usage.prompt_tokens == len(server[2].tokenizer.encode("The lighthouse keeper"))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    pieces, usage = [], None
    for event in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if event.choices:
            pieces.append(event.choices[0].text)
        if event.usage:
            usage = event.usage
    assert "".join(pieces) == full
    assert usage.completion_tokens == 12


def test_chat_stream_and_not(client):
    messages = [{"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    text = "".join(e.choices[0].delta.content or "" for e in stream if e.choices)
    assert text == full.choices[0].message.content


def test_stop_string_is_honoured_and_cut(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == base[:base.index(stop)] and cut.finish_reason == "stop"


def test_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    comp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == 3


@pytest.mark.parametrize("body, status", [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ({"model": MODEL}, 400),
    ({"model": MODEL, "prompt": 12}, 400),
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": MODEL, "prompt": "x " * 600, "max_tokens": 4}, 400),
    ({"model": MODEL, "prompt": [10 ** 9]}, 400),
    ({"model": MODEL, "prompt": ""}, 400),
])
def test_bad_input_is_a_4xx_with_an_error_body(server, body, status):
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_malformed_json_and_auth(server):
    url = server[0] + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"Authorization": "Bearer secret",
                                                         "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert httpx.post(url, json={"model": MODEL, "messages": []}).status_code == 401
    assert httpx.get(server[0] + "/health").status_code == 200  # open without the key
    assert httpx.get(server[0] + "/v1/models").status_code == 401


def test_request_id_is_honoured(server):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                   headers={"Authorization": "Bearer secret", "X-Request-Id": "my-id-1"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "my-id-1" and r.json()["id"] == "my-id-1"


def test_disconnect_aborts(server):
    url, llm, engine = server

    async def main():
        aborted_before = llm.stats().num_finished["abort"]
        async with httpx.AsyncClient() as c:
            async with c.stream("POST", url + "/v1/completions", headers={"Authorization": "Bearer secret"},
                                json={"model": MODEL, "prompt": "a", "max_tokens": 400, "stream": True,
                                      "ignore_eos": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # hang up mid-stream
        for _ in range(100):
            stats = llm.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
                return stats.num_finished["abort"] == aborted_before + 1
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_tokenize_detokenize_models_metrics(server):
    h = {"Authorization": "Bearer secret"}
    ids = httpx.post(server[0] + "/tokenize", json={"prompt": "hello world"}, headers=h).json()["tokens"]
    assert httpx.post(server[0] + "/detokenize", json={"tokens": ids}, headers=h).json()["prompt"] == "hello world"
    assert httpx.get(server[0] + "/v1/models", headers=h).json()["data"][0]["id"] == MODEL
    metrics = httpx.get(server[0] + "/metrics", headers=h).text
    assert "vllm:time_to_first_token_seconds_count" in metrics


def test_same_request_id_from_two_clients_does_not_collide(server):
    async def one():
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(server[0] + "/v1/completions", headers={"Authorization": "Bearer secret",
                                                                      "X-Request-Id": "shared-id"},
                             json={"model": MODEL, "prompt": "a", "max_tokens": 8, "ignore_eos": True})
            return r.status_code, r.headers["X-Request-Id"], r.json()["id"]

    async def main():
        return await asyncio.gather(one(), one())

    assert asyncio.run(main()) == [(200, "shared-id", "shared-id")] * 2
