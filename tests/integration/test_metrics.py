"""The series engines and the proxy export, read back through Prometheus' own parser: vLLM's names and
labels, each thing counted once (requests by the proxy, steps and engine time by the engines, a prompt's
lookup and each request's stage times by one engine only), no `_created` series; /metrics open as vLLM's
unless asked to be behind the API key."""
import asyncio

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.proxy.app import build_app
from epdserve.services.proxy.generation import Chunk
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.serving import OpenAIServing
from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.config import ModelConfig
from epdserve.shared.engine.llm import LLM
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.processing.tokenizer import load_tokenizer


def samples(text: bytes) -> list:
    return [s for family in text_string_to_metric_families(text.decode()) for s in family.samples]


def value(all_samples, name: str, **labels) -> float:
    return sum(s.value for s in all_samples if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def engine(tiny_model_paths):
    return LLM(model=tiny_model_paths["llama"], num_kv_blocks=64, max_num_batched_tokens=8).engine


def run(engine, metrics: ServiceMetrics, prompt_len: int, max_tokens: int, ends_here: bool = True, **kwargs):
    """One request to its end, as a service runs it (`kwargs`: peer_token_ids, for one continued here)."""
    engine.on_step_tokens = metrics.iteration_tokens.observe
    steps_before = engine.step_timer.num_steps
    engine.add_request(f"r{steps_before}", {"prompt_token_ids": list(range(1, prompt_len + 1))},
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kwargs)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                metrics.finished(out, ends_here)
    engine.on_step_tokens = None
    return engine.step_timer.num_steps - steps_before


def times(metrics: ServiceMetrics) -> tuple[float, ...]:
    """The observations of the queue, prefill, decode and inference time histograms."""
    got = samples(generate_latest(metrics.registry))
    return tuple(value(got, f"vllm:request_{n}_time_seconds_count")
                 for n in ("queue", "prefill", "decode", "inference"))


def test_engine_series_carry_model_role_and_engine_and_count_steps_and_time(engine):
    metrics = ServiceMetrics("unified", "unified-0", "tiny", engine.stats)
    before = engine.stats()
    num_steps = run(engine, metrics, prompt_len=20, max_tokens=5)  # 8-token chunks: 3 prefill steps, 4 decodes
    after = engine.stats()  # what the stats line reports
    assert (after.num_prompt_tokens - before.num_prompt_tokens, after.num_generation_tokens
            - before.num_generation_tokens) == (20, 5)
    got = samples(generate_latest(metrics.registry))
    assert got and all(s.labels.items() >= {"model_name": "tiny", "engine": "0", "role": "unified",
                                            "engine_id": "unified-0"}.items() for s in got)
    assert not [s.name for s in got if s.name.endswith("_created")]
    assert num_steps == 7
    assert value(got, "vllm:iteration_tokens_total_count") == 7
    assert value(got, "vllm:iteration_tokens_total_sum") == 20 + 4  # the prompt, then one token a decode
    assert value(got, "vllm:iteration_tokens_total_bucket", le="8.0") == 7
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert value(got, f"vllm:request_{name}_seconds_count") == 1, name
    inference = value(got, "vllm:request_inference_time_seconds_sum")
    prefill = value(got, "vllm:request_prefill_time_seconds_sum")
    assert inference == pytest.approx(prefill + value(got, "vllm:request_decode_time_seconds_sum"))
    # The request count is the proxy's: an engine reports its share under another name.
    assert value(got, "epdserve:engine_requests_finished_total", finished_reason="length") >= 1
    assert not [s for s in got if s.name.startswith("vllm:request_success")]
    assert value(got, "epdserve:num_kv_blocks") == 64
    # Its 20 prompt tokens were looked up once (chunked over 3 steps) and came from somewhere once.
    assert after.prefix_cache_queries - before.prefix_cache_queries == 20
    assert sum(after.prompt_tokens_by_source.values()) - sum(before.prompt_tokens_by_source.values()) == 20
    assert value(got, "vllm:prompt_tokens_by_source_total") == sum(after.prompt_tokens_by_source.values())
    assert {s.labels["reason"]: s.value for s in got if s.name == "vllm:num_requests_waiting_by_reason"} == \
        {"capacity": 0, "deferred": 0}


def test_each_request_is_timed_and_looked_up_once_over_the_engines_it_crosses(engine):
    """Queue and prefill time, and the prompt's lookup, by the engine that prefilled the request; decode and
    inference time by the one it ended on."""
    looked_up = engine.stats().prefix_cache_queries
    prefill = ServiceMetrics("prefill", "prefill-0", "tiny", engine.stats)
    run(engine, prefill, prompt_len=10, max_tokens=1, ends_here=False)  # decode goes on
    assert times(prefill) == (1, 1, 0, 0)
    assert engine.stats().prefix_cache_queries == looked_up + 10
    decode = ServiceMetrics("decode", "decode-0", "tiny", engine.stats)
    # Continued from prefill's first token (its KV recomputed here: this engine has no connector).
    run(engine, decode, prompt_len=10, max_tokens=4, peer_token_ids=[[7]])
    assert times(decode) == (0, 0, 1, 1)
    assert engine.stats().prefix_cache_queries == looked_up + 10  # not looked up again
    ended = ServiceMetrics("prefill", "prefill-1", "tiny", engine.stats)
    run(engine, ended, prompt_len=12, max_tokens=1)  # its first token is its last: it ends on prefill
    assert times(ended) == (1, 1, 1, 1)
    assert engine.stats().prefix_cache_queries == looked_up + 10 + 12


def test_encoder_reports_its_cache_queries_and_hits():
    counts = {"queries": 0, "hits": 0}
    metrics = ServiceMetrics("encoder", "encoder-0", "llava", mm_cache=lambda: (counts["queries"], counts["hits"]))
    counts.update(queries=5, hits=2)
    got = samples(generate_latest(metrics.registry))
    assert value(got, "vllm:mm_cache_queries_total", model_name="llava", role="encoder") == 5
    assert value(got, "vllm:mm_cache_hits_total", engine_id="encoder-0") == 2
    assert not [s for s in got if s.name.startswith("vllm:num_requests")]  # an encoder has no batch


class CountingBackend:
    """Streams `num_tokens` one-token chunks, the last with finish reason "length"."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    async def generate(self, gen):
        for i in range(self.num_tokens):
            await asyncio.sleep(0.001)
            yield Chunk([42], [], "length" if i == self.num_tokens - 1 else None,
                        num_cached_tokens=3 if i == 0 else None)


def test_proxy_counts_each_request_once_and_every_response_by_status(tiny_model_paths):
    path = tiny_model_paths["llama"]
    config = ModelConfig.from_pretrained(path)
    metrics = ProxyMetrics("tiny")
    serving = OpenAIServing("tiny", load_tokenizer(path), CountingBackend(4), config.max_model_len,
                            config.vocab_size, metrics)
    app = build_app(serving, metrics, api_key="secret")
    auth = {"Authorization": "Bearer secret"}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            ok = await client.post("/v1/completions", headers=auth,
                                   json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 4})
            streamed = await client.post("/v1/completions", headers=auth,
                                         json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
            bad = await client.post("/v1/completions", headers=auth, json={"prompt": [1], "max_tokens": -1})
            unauthorized = await client.post("/v1/completions", json={"prompt": [1]})
            missing = await client.get("/v2/nothing", headers=auth)
            # Probes and scrapes, not API traffic: not counted.
            probes = [await client.get(path, headers=auth) for path in ("/health", "/ready", "/metrics")]
            return [r.status_code for r in (ok, streamed, bad, unauthorized, missing, *probes)]

    assert asyncio.run(main()) == [200, 200, 400, 401, 404, 200, 200, 200]
    got = samples(metrics.render()[0])
    assert not [s.name for s in got if s.name.endswith("_created")]
    assert all(s.labels["model_name"] == "tiny" for s in got)
    assert {status: value(got, "epdserve:http_responses_total", status=status)
            for status in ("200", "400", "401", "404")} == {"200": 2, "400": 1, "401": 1, "404": 1}
    assert value(got, "vllm:request_success_total", finished_reason="length") == 2
    # The requests in flight have a name of their own: the engines' num_requests_* count the same requests.
    assert value(got, "epdserve:proxy_requests_in_flight") == 0
    assert not [s for s in got if s.name.startswith("vllm:num_requests")]
    assert value(got, "vllm:request_prompt_tokens_count") == 2
    assert value(got, "vllm:request_prompt_tokens_sum") == 5 + 3
    assert value(got, "vllm:request_prompt_tokens_bucket", le="5.0") == 2
    assert value(got, "vllm:request_generation_tokens_sum") == 8
    assert value(got, "vllm:request_max_num_generation_tokens_sum") == 8
    assert value(got, "vllm:generation_tokens_total") == 8
    assert value(got, "vllm:prompt_tokens_cached_total") == 6
    assert value(got, "vllm:request_params_n_sum") == 2
    assert value(got, "vllm:request_params_max_tokens_sum") == 8
    assert value(got, "vllm:request_time_per_output_token_seconds_count") == 2
    tpot = value(got, "vllm:request_time_per_output_token_seconds_sum")
    assert 0 < tpot < value(got, "vllm:e2e_request_latency_seconds_sum")


def test_metrics_is_open_beside_an_api_key_unless_asked_to_be_behind_it(tiny_model_paths):
    """As vLLM's /metrics: a key on the API leaves it open (scrapers and vLLM's dashboards expect that);
    with metrics_require_api_key (--metrics-require-api-key) it takes the key too. /health is open either way,
    every other route needs the key."""
    path = tiny_model_paths["llama"]
    config = ModelConfig.from_pretrained(path)
    metrics = ProxyMetrics("tiny")
    serving = OpenAIServing("tiny", load_tokenizer(path), CountingBackend(1), config.max_model_len,
                            config.vocab_size, metrics)

    async def statuses(app) -> dict[str, tuple[int, int]]:
        """{route: (status without the key, with it)}."""
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return {route: ((await client.get(route)).status_code,
                            (await client.get(route, headers={"Authorization": "Bearer secret"})).status_code)
                    for route in ("/metrics", "/health", "/v1/models")}

    assert asyncio.run(statuses(build_app(serving, metrics, api_key="secret"))) == \
        {"/metrics": (200, 200), "/health": (200, 200), "/v1/models": (401, 200)}
    assert asyncio.run(statuses(build_app(serving, metrics, api_key="secret", metrics_require_api_key=True))) == \
        {"/metrics": (401, 200), "/health": (200, 200), "/v1/models": (401, 200)}
