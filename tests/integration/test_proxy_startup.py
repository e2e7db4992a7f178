"""Until every role has a ready instance the proxy's API answers 503 saying what it waits for, and its log
shows no URL; the first check that finds it ready logs the ready line, with the URL, and opens the API for
good (services/proxy/startup.py). Probes and scrapes answer throughout."""
import asyncio
import logging

import httpx

from epdserve.services.proxy.app import build_app
from epdserve.services.proxy.generation import Chunk
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing
from epdserve.services.proxy.startup import Startup
from epdserve.shared.config import ModelConfig
from epdserve.shared.processing.tokenizer import load_tokenizer


class OneToken:
    async def generate(self, gen):
        yield Chunk([42], [], "length", num_cached_tokens=0)


def test_the_api_answers_503_until_every_role_is_ready_then_stays_open(tiny_model_paths, caplog):
    path = tiny_model_paths["llama"]
    config = ModelConfig.from_pretrained(path)
    metrics = ProxyMetrics("tiny")
    serving = OpenAIServing("tiny", load_tokenizer(path), OneToken(), config.max_model_len, config.vocab_size,
                            metrics)
    healthy = {"prefill": 0, "decode": 0}

    def readiness():
        missing = [role for role, count in healthy.items() if not count]
        return not missing, {"healthy_instances": dict(healthy), "unavailable_roles": missing}

    startup = Startup(readiness, "tiny", "http://127.0.0.1:8000")
    app = build_app(serving, metrics, waiting_for=startup.waiting_for)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
            starting = [await client.get("/v1/models"), await client.post("/v1/completions", json=completion)]
            probes = [(await client.get(path)).status_code for path in ("/health", "/metrics")]
            healthy["prefill"] = 1
            still = await client.get("/v1/models")
            healthy["decode"] = 1
            ready = [await client.get("/v1/models"), await client.post("/v1/completions", json=completion)]
            healthy.update(prefill=0, decode=0)  # later outages are the router's to answer, request by request
            after = await client.get("/v1/models")
            return starting, probes, still, ready, after

    with caplog.at_level(logging.INFO, logger="epdserve.services.proxy.startup"):
        starting, probes, still, ready, after = asyncio.run(main())
    for response in starting:
        assert response.status_code == 503 and response.headers["Retry-After"] == "5"
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert error["message"].startswith("tiny is starting: no prefill and decode instance is ready yet")
    assert probes == [200, 200]
    assert still.status_code == 503 and "no decode instance is ready yet" in still.json()["error"]["message"]
    assert [r.status_code for r in ready] == [200, 200] and after.status_code == 200
    assert [r.getMessage() for r in caplog.records] == ["proxy for tiny ready: http://127.0.0.1:8000/v1"]
    text = metrics.render()[0].decode()
    assert 'epdserve:http_responses_total{model_name="tiny",status="503"} 3.0' in text  # API traffic, counted


def test_the_proxy_process_runs_without_torch(llava_demo_path):
    """The proxy tokenizes, templates, hashes images and routes: none of it needs torch, and a proxy that
    loads none starts in seconds and takes a few hundred MB less (its libraries are mapped into no page)."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = subprocess.Popen([sys.executable, "-m", "epdserve.services.cli", "serve", "proxy", "--model",
                              llava_demo_path, "--port", str(port), "--unified", "127.0.0.1:1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # serving: the model folder checked, the tokenizer, image processor and router built
            assert proxy.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 503:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with open(f"/proc/{proxy.pid}/maps") as maps:
            assert "libtorch" not in maps.read()
    finally:
        proxy.kill()
        proxy.wait()
