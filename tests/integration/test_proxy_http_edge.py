"""The proxy's HTTP edge served over real HTTP: the OpenAPI schema it publishes, and what a client that
hangs up does at each stage of its request (the backend stalls on purpose, so each stage can be reached)."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from epdserve.services.proxy.app import build_app
from epdserve.services.proxy.generation import Chunk
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing
from epdserve.shared.config import ModelConfig
from epdserve.shared.processing.tokenizer import load_tokenizer

AUTH = {"Authorization": "Bearer secret"}


class StallingBackend:
    """Streams `chunks_before_stall` one-token chunks, then nothing until the request is aborted (or, with
    `fail`, raises an unexpected error: a fault of the proxy's own)."""

    def __init__(self) -> None:
        self.chunks_before_stall = 0
        self.fail = False
        self.started = threading.Event()
        self.aborted = threading.Event()

    def reset(self, chunks_before_stall: int, fail: bool = False) -> None:
        self.chunks_before_stall, self.fail = chunks_before_stall, fail
        self.started.clear()
        self.aborted.clear()

    async def generate(self, gen):
        self.started.set()
        try:
            for _ in range(self.chunks_before_stall):
                yield Chunk([42], [], num_cached_tokens=0)
            if self.fail:
                raise RuntimeError("a bug")
            await asyncio.sleep(3600)
        finally:
            self.aborted.set()


@pytest.fixture(scope="module")
def server(tiny_model_paths):
    path = tiny_model_paths["llama"]
    config = ModelConfig.from_pretrained(path)
    backend = StallingBackend()
    metrics = ProxyMetrics("tiny")
    serving = OpenAIServing("tiny", load_tokenizer(path), backend, config.max_model_len, config.vocab_size, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(serving, metrics, api_key="secret"), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", backend
    srv.should_exit = True
    thread.join(10)


def client_disconnect_aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("epdserve:request_aborts_total") and 'reason="client_disconnect"' in line)


def hang_up_after(url: str, stream: bool, events: int) -> None:
    """Send a completion, read `events` stream events (0: not even the headers), then hang up."""
    body = {"prompt": "Hello", "max_tokens": 8, "stream": stream}
    with httpx.Client(headers=AUTH, timeout=httpx.Timeout(10, read=0.5 if events == 0 else 10)) as client:
        try:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                for line in r.iter_lines():
                    seen += line.startswith("data:")
                    if seen == events:
                        return
        except httpx.ReadTimeout:
            assert events == 0


@pytest.mark.parametrize("stream, events", [(True, 0), (True, 1), (False, 0)],
                         ids=["stream-before-first-token", "stream-mid-way", "not-streaming"])
def test_a_client_that_hangs_up_aborts_its_request_and_is_counted(server, stream, events):
    url, backend = server
    backend.reset(chunks_before_stall=events)
    before = client_disconnect_aborts(url)
    hang_up_after(url, stream, events)
    assert backend.started.is_set()
    assert backend.aborted.wait(10), "the request was not aborted"
    deadline = time.monotonic() + 10
    while client_disconnect_aborts(url) != before + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(server):
    url, backend = server
    backend.reset(chunks_before_stall=2, fail=True)
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError" and "RuntimeError" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])


def test_openapi_schema_documents_400_and_needs_the_key(server):
    url, _ = server
    assert httpx.get(url + "/openapi.json").status_code == 401
    schema = httpx.get(url + "/openapi.json", headers=AUTH).json()
    operations = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert set(operations) == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for op in (op for ops in schema["paths"].values() for op in ops.values()):
        assert "422" not in op["responses"]
    for op in operations.values():
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    assert set(components["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("values, status", [
    (["Bearer secret"], 200), (["bearer secret"], 200), (["BEARER secret"], 200), (["Bearer  secret"], 200),
    (["Basic secret"], 401), (["Bearer wrong"], 401), ([], 401),
    # Two headers are refused whichever comes first: a check of one and a use of the other could disagree.
    (["Bearer secret", "Bearer wrong"], 400), (["Bearer wrong", "Bearer secret"], 400),
], ids=["canonical", "lowercase-scheme", "uppercase-scheme", "extra-spaces", "other-scheme", "wrong-key",
        "no-header", "good-then-bad", "bad-then-good"])
def test_the_api_key_scheme_is_case_insensitive_and_one_header_only(server, values, status):
    url, _ = server
    r = httpx.get(url + "/v1/models", headers=httpx.Headers([("Authorization", v) for v in values]))
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["code"] == status
