"""An engine's series on /metrics are vLLM's: its names and labels (model_name, engine) beside ours (role,
engine_id); waiting requests by reason, those held back for their KV ("deferred") among the waiting ones as
in vLLM; the prompt counters (prefix cache, KV tiers, tokens by source) as the engine counted them."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.engine.outputs import EngineStats


LABELS = {"model_name": "m", "engine": "0", "role": "prefill", "engine_id": "p0"}


def scrape(stats: EngineStats) -> dict[tuple[str, tuple], float]:
    """{(series, its labels beyond the common ones, sorted): value}; every series carries the common ones."""
    text = generate_latest(ServiceMetrics("prefill", "p0", "m", lambda: stats).registry).decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert all(s.labels.items() >= LABELS.items() for s in samples)
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in LABELS))): s.value for s in samples}


def test_engine_series_are_vllms():
    stats = EngineStats(2, 3, 100, 128, 0.25, 640, 128, 1, {}, 10, {}, 512, 40, num_waiting_for_kv=4,
                        external_prefix_cache_queries=640, external_prefix_cache_hits=96,
                        prompt_tokens_by_source={"local_compute": 416, "local_cache_hit": 128,
                                                 "external_kv_transfer": 96})
    got = scrape(stats)
    assert got[("vllm:num_requests_running", ())] == 2
    assert got[("vllm:num_requests_waiting", ())] == 3 + 4  # the queue and those waiting for their KV
    assert got[("vllm:num_requests_waiting_by_reason", (("reason", "capacity"),))] == 3
    assert got[("vllm:num_requests_waiting_by_reason", (("reason", "deferred"),))] == 4
    assert got[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert got[("vllm:prefix_cache_queries_total", ())] == 640
    assert got[("vllm:prefix_cache_hits_total", ())] == 128
    assert got[("vllm:external_prefix_cache_queries_total", ())] == 640
    assert got[("vllm:external_prefix_cache_hits_total", ())] == 96
    assert {labels[0][1]: value for (name, labels), value in got.items()
            if name == "vllm:prompt_tokens_by_source_total"} == \
        {"local_compute": 416, "local_cache_hit": 128, "external_kv_transfer": 96}
    assert got[("vllm:num_preemptions_total", ())] == 1
    assert got[("epdserve:prompt_tokens_computed_total", ())] == 512  # ours: the work, not the requests
    assert not [name for name, _ in got if name.startswith("epdserve:") and name.removeprefix("epdserve:") in
                {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total"}]
