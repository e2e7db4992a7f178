"""`--request-trace` at the proxy's HTTP edge, read by the official `openai` client: the trace is an extra
top-level field of a non-streamed body, and of exactly one streamed chunk - the usage chunk, or else the
last one - while the client parses every response as usual. A real engine runs in the same process
(run-batch's backend); the services' own spans are tested on real stacks (tests/e2e/test_request_trace.py)."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from epdserve import AsyncLLM
from epdserve.services.batch.engine_backend import EngineBackend
from epdserve.services.proxy.app import build_app
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing

MODEL = "tiny"


@pytest.fixture(scope="module")
def url(tiny_model_paths):
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_engine_config(tiny_model_paths["llama"], num_kv_blocks=128, max_model_len=256),
                       detokenize=False)
    llm = AsyncLLM(engine)
    metrics = ProxyMetrics(MODEL)
    serving = OpenAIServing(MODEL, engine.tokenizer, EngineBackend(llm), engine.model_config.max_model_len,
                            engine.model_config.vocab_size, metrics, request_trace=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(serving, metrics), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    llm.shutdown()


def check_trace(traces: list[dict], request_id_prefix: str) -> None:
    (trace,) = traces
    assert trace["request_id"].startswith(request_id_prefix + ".")  # the id the services know it by
    names = [s["name"] for s in trace["spans"]]
    assert names[0] == "proxy.request" and "proxy.first_token" in names
    root, first = trace["spans"][0], trace["spans"][names.index("proxy.first_token")]
    assert root["start"] == first["start"] <= first["end"] <= root["end"]


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=60, headers={"X-Request-Id": "traced"}) as r:
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": ["a b", "c d e"]}),  # two requests: the trace of each, after both end
])
def test_a_stream_carries_the_trace_in_its_last_chunk(url, include_usage, path, body):
    body |= {"model": MODEL, "max_tokens": 5, "stream": True, "temperature": 1.0, "seed": 3,
             "stream_options": {"include_usage": include_usage}}
    events = stream_events(url, path, body)
    with_trace = [i for i, event in enumerate(events) if "epdserve_trace" in event]
    assert with_trace == [len(events) - 1]
    last = events[-1]
    assert ("usage" in last) == include_usage
    if not include_usage:  # the chunk that finished the last choice
        assert last["choices"][0]["finish_reason"] is not None
    traces = last["epdserve_trace"]
    assert len(traces) == len(body.get("prompt", [0]))
    for trace in traces:
        check_trace([trace], "traced")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    create = client.chat.completions.create if "messages" in body else client.completions.create
    chunks = list(create(**body))
    assert chunks[-1].model_extra["epdserve_trace"][0]["spans"][0]["name"] == "proxy.request"


def test_a_body_carries_one_trace_per_prompt(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          extra_headers={"X-Request-Id": "one"})
    check_trace(chat.model_extra["epdserve_trace"], "one")
    completion = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=3, stream=False)
    traces = completion.model_extra["epdserve_trace"]
    assert len(traces) == 2 and traces[0]["request_id"] != traces[1]["request_id"]
    for trace in traces:
        check_trace([trace], completion.id)
