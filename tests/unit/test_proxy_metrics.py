"""The proxy's request-level series are vLLM's: its names, its buckets (TTFT, ITL and TPOT, end-to-end,
token counts up to the model's length), a single-token request's time per output token 0 as in vLLM."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.proxy.metrics import ProxyMetrics, token_buckets
from epdserve.shared.engine.sampling_params import SamplingParams

# vllm/v1/metrics/loggers.py's buckets.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0]


def bounds(metrics: ProxyMetrics) -> dict[str, list[float]]:
    """{histogram: its finite bucket bounds}."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                out.setdefault(family.name, []).append(float(sample.labels["le"]))
    return out


def test_vllms_names_and_buckets():
    got = bounds(ProxyMetrics("m", max_model_len=2048))
    assert got["vllm:time_to_first_token_seconds"] == VLLM_TTFT
    assert got["vllm:inter_token_latency_seconds"] == got["vllm:request_time_per_output_token_seconds"] == VLLM_ITL
    assert got["vllm:e2e_request_latency_seconds"] == VLLM_REQUEST
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # vLLM's 1-2-5 buckets up to max_model_len
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                 "request_params_max_tokens"):
        assert got[f"vllm:{name}"] == tokens, name
    assert got["vllm:request_params_n"] == [1, 2, 5, 10, 20]
    assert token_buckets(None)[-1] == 1_000_000 and token_buckets(1) == (1,)


def test_a_single_token_request_takes_no_time_per_output_token():
    metrics = ProxyMetrics("m")
    metrics.finished("length", 5, 0, 1, SamplingParams(max_tokens=1), e2e_seconds=0.4, ttft_seconds=0.4)
    # n = 2: 3 tokens in all, the longer sequence's 2 tokens over the 0.5 s after the first.
    metrics.finished("stop", 5, 0, 3, SamplingParams(n=2, max_tokens=4), e2e_seconds=0.9, ttft_seconds=0.4,
                     longest_sequence_tokens=2)
    samples = {s.name: s.value for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples if not s.labels.get("le")}
    assert samples["vllm:request_time_per_output_token_seconds_count"] == 2
    assert samples["vllm:request_time_per_output_token_seconds_sum"] == 0.5
    assert samples["vllm:request_max_num_generation_tokens_sum"] == 1 + 2
    assert samples["vllm:request_generation_tokens_sum"] == samples["vllm:generation_tokens_total"] == 1 + 3
