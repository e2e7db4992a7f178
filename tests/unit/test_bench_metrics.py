"""`epdserve bench serve` arithmetic on synthetic timelines: TTFT, TPOT, ITL, percentiles, goodput, peaks,
arrival schedules, and how a streamed response becomes token timestamps."""
import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from epdserve.services.bench.metrics import (RequestOutput, distribution, is_good, parse_goodput, peak_output_rate,
                                             per_request, percentile_key, summarize, trace_summary)
from epdserve.services.bench.runner import Endpoint, LoadShape, arrival_times, send_request


def timeline(start: float, ttft: float, gaps: list[float], prompt_len: int = 100, output_len: int | None = None,
             turn: int | None = None) -> RequestOutput:
    """A successful request whose chunks arrive at start+ttft, then after each gap; one token per chunk."""
    return RequestOutput(success=True, prompt_len=prompt_len,
                         output_len=len(gaps) + 1 if output_len is None else output_len, ttft=ttft, itl=list(gaps),
                         latency=ttft + sum(gaps), start_time=start, turn=turn)


def failed(prompt_len: int = 100) -> RequestOutput:
    return RequestOutput(prompt_len=prompt_len, error="HTTP 503: no healthy decode instance")


# Three requests: TTFT 0.1/0.2/0.4 s; ITL gaps 0.05 x4, 0.1 x2, none (one token).
A = timeline(0.0, 0.1, [0.05] * 4, prompt_len=10)
B = timeline(0.5, 0.2, [0.1, 0.1], prompt_len=20)
C = timeline(1.0, 0.4, [], prompt_len=30)


def test_tpot_excludes_the_first_token():
    assert A.tpot == pytest.approx(0.2 / 4)
    assert B.tpot == pytest.approx(0.2 / 2)
    assert C.tpot == 0.0  # one output token: no TPOT
    # Several tokens per chunk: TPOT divides by tokens, not chunks.
    assert timeline(0, 0.1, [0.3], output_len=4).tpot == pytest.approx(0.3 / 3)


def test_summary_counts_and_throughputs():
    r = summarize([A, B, C, failed()], duration_s=2.0, percentiles=[50, 90, 99])
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 60  # a failed request's prompt is not counted
    assert r["total_output_tokens"] == 5 + 3 + 1
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(34.5)
    assert r["request_goodput"] is None
    assert r["duration"] == 2.0


def test_latency_statistics_in_milliseconds():
    r = summarize([A, B, C], duration_s=2.0, percentiles=[50, 90, 99])
    assert r["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert r["median_ttft_ms"] == pytest.approx(200)
    assert r["p50_ttft_ms"] == pytest.approx(200)
    # Linear interpolation between the sorted samples 100, 200, 400 ms (numpy's default, as vLLM).
    assert r["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 200)
    assert r["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)
    assert r["std_ttft_ms"] == pytest.approx(np.std([100, 200, 400]))
    # TPOT: only requests with more than one output token.
    assert r["mean_tpot_ms"] == pytest.approx((50 + 100) / 2)
    # ITL: every gap of every request pooled (4 x 50 ms, 2 x 100 ms).
    assert r["mean_itl_ms"] == pytest.approx((4 * 50 + 2 * 100) / 6)
    assert r["median_itl_ms"] == pytest.approx(50)
    assert r["p99_itl_ms"] == pytest.approx(100)
    # E2EL = TTFT + gaps: 300, 400, 400 ms.
    assert r["mean_e2el_ms"] == pytest.approx(1100 / 3)
    assert r["median_e2el_ms"] == pytest.approx(400)


def test_fractional_percentiles_and_selected_metrics():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"
    r = summarize([A, B, C], 1.0, [99.9], percentile_metrics=["ttft"])
    assert "p99.9_ttft_ms" in r and "mean_itl_ms" not in r
    assert distribution("x", [0.001, 0.003], [50]) == {"mean_x_ms": pytest.approx(2), "median_x_ms": pytest.approx(2),
                                                       "std_x_ms": pytest.approx(1), "p50_x_ms": pytest.approx(2)}


def test_goodput_counts_requests_within_every_slo():
    slo = parse_goodput(["ttft:250", "tpot:60"])
    assert slo == {"ttft": 250.0, "tpot": 60.0}
    assert [is_good(o, slo) for o in (A, B, C)] == [True, False, False]  # B: TPOT 100 ms; C: TTFT 400 ms
    assert is_good(C, {"tpot": 0.0})  # one output token: TPOT counts as 0
    assert is_good(A, {"e2el": 301.0}) and not is_good(B, {"e2el": 399.0})
    r = summarize([A, B, C, failed()], 2.0, [50], goodput_slo_ms=slo)
    assert r["request_goodput"] == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [["ttft"], ["speed:10"], ["ttft:-1"], ["ttft:fast"]])
def test_goodput_rejects_malformed_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_no_successful_request_reports_zeros():
    r = summarize([failed(), failed()], 1.0, [50, 99])
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (0, 2, 0)
    assert r["mean_ttft_ms"] == 0 and r["p99_itl_ms"] == 0
    assert (r["max_output_tokens_per_s"], r["max_concurrent_requests"]) == (0.0, 0)


def test_peak_output_rate_and_concurrency():
    # A: tokens at 0.1, 0.15, ..., 0.3 (second 0); B: 0.7, 0.8, 0.9 (second 0); C: 1.4 (second 1).
    peak_tokens, peak_requests = peak_output_rate([A, B, C])
    assert peak_tokens == 8.0
    assert peak_requests == 1  # A ends at 0.3, B runs 0.5-0.9, C 1.0-1.4: never two at once
    overlapping = [timeline(0.0, 0.5, [0.5]), timeline(0.2, 0.1, [0.1]), timeline(1.0, 0.1, [])]
    assert peak_output_rate(overlapping)[1] == 2  # the first ends exactly when the third starts: not overlapping


def test_later_turn_ttft_and_per_request_arrays():
    turns = [timeline(0, 1.0, [0.1], turn=0), timeline(2, 0.2, [0.1], turn=1), timeline(3, 0.4, [0.1], turn=2)]
    r = summarize(turns, 5.0, [50])
    assert r["mean_later_turns_ttft_ms"] == pytest.approx(300)
    assert r["mean_ttft_ms"] == pytest.approx(1600 / 3)
    arrays = per_request([*turns, failed(7)])
    assert arrays["turns"] == [0, 1, 2, None]
    assert arrays["input_lens"] == [100, 100, 100, 7]
    assert arrays["output_lens"] == [2, 2, 2, 0]
    assert arrays["errors"][:3] == ["", "", ""] and arrays["errors"][3]
    assert "turns" not in per_request([A]) and "generated_texts" in per_request([A], with_texts=True)


def test_arrival_schedules():
    assert arrival_times(3, LoadShape(math.inf)) == [0.0, 0.0, 0.0]
    assert arrival_times(4, LoadShape(2.0, arrival="fixed")) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_times(4, LoadShape(2.0, burstiness=math.inf)) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_times(4000, LoadShape(4.0, seed=7))
    assert poisson[0] > 0.0 and all(b >= a for a, b in zip(poisson, poisson[1:]))
    assert poisson[-1] == pytest.approx(1000.0)  # n requests take n / rate seconds, whatever the seed
    assert poisson == arrival_times(4000, LoadShape(4.0, seed=7))  # seeded: every run sends the same schedule
    gaps = np.diff(poisson)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1
    regular = np.diff(arrival_times(4000, LoadShape(4.0, burstiness=16.0, seed=7)))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.25, rel=0.1)  # gamma(k): CV 1/sqrt(k)
    with pytest.raises(ValueError):
        arrival_times(2, LoadShape(0.0))


def test_arrivals_are_the_schedule_vllm_sends_for_the_same_seed():
    # vllm-project/vllm vllm/benchmarks/serve.py (commit 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1): main_async
    # seeds numpy's global generator, then get_request draws one gamma gap per request and scales their
    # running sum to end at num_requests / request_rate.
    for rate, burstiness, seed in ((4.0, 1.0, 0), (0.5, 0.25, 11)):
        np.random.seed(seed)
        due = np.cumsum([np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(50)])
        vllm = due * (50 / rate) / due[-1]
        assert arrival_times(50, LoadShape(rate, burstiness, seed=seed)) == pytest.approx(vllm.tolist())


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _stream(endpoint: Endpoint, body: bytes, status: int = 200):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, endpoint, {}, prompt_len=5, request_id="r0", t0=0.0)

    return asyncio.run(go())


CHAT = Endpoint("http://127.0.0.1:1/v1/chat/completions", "m", chat=True)
COMPLETIONS = Endpoint("http://127.0.0.1:1/v1/completions", "m", chat=False)


def test_chat_stream_timestamps_token_chunks_only():
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},  # no token
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": None}]},  # a token whose text is held back
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},  # closing chunk: no token
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
                                  "prompt_tokens_details": {"cached_tokens": 8}}},
        "[DONE]")
    out = _stream(CHAT, body)
    assert out.success and out.error == ""
    assert out.generated_text == "Hello"
    assert len(out.itl) == 2  # three token chunks: TTFT, then two gaps
    assert out.ttft > 0 and out.latency >= out.ttft + sum(out.itl)
    assert (out.prompt_len, out.output_len, out.cached_tokens) == (12, 4, 8)


def test_completion_stream_without_usage_counts_chunks():
    body = _sse(*[{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b", "c")],
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, "[DONE]")
    out = _stream(COMPLETIONS, body)
    assert out.success and (out.prompt_len, out.output_len, len(out.itl)) == (5, 3, 2)
    assert out.cached_tokens is None


def test_failures_are_recorded_not_raised():
    out = _stream(CHAT, b'{"error": {"message": "no healthy decode instance"}}', status=503)
    assert not out.success and out.error.startswith("HTTP 503")
    out = _stream(CHAT, _sse({"error": {"message": "boom", "code": 502}}, "[DONE]"))
    assert not out.success and "boom" in out.error
    out = _stream(CHAT, _sse("[DONE]"))
    assert not out.success and "without a token" in out.error


def traced(ttft: float, *spans: tuple[str, float, int]) -> RequestOutput:
    """A completed request whose server trace holds `spans` (name, seconds, bytes), one after another."""
    start, entries = 100.0, []
    for name, seconds, num_bytes in spans:
        entries.append({"name": name, "engine_id": "decode-0", "start": start, "end": start + seconds,
                        "num_bytes": num_bytes, "num_blocks": num_bytes // 1024})
        start += seconds
    return RequestOutput(success=True, ttft=ttft, latency=1.0, output_len=4,
                         trace=[{"request_id": "r", "spans": entries}])


def test_trace_summary_medians_over_the_requests_that_pulled_kv():
    outputs = [traced(0.5, ("prefill.compute", 0.3, 0), ("kv.transfer", 0.01, 4096)),
               traced(0.2, ("kv.transfer", 0.03, 2048), ("kv.transfer", 0.01, 2048)),  # two pulls: summed
               traced(0.4, ("kv.transfer", 0.02, 8192)),
               traced(0.3, ("kv.recompute:blocks_not_found", 0.2, 0)),
               RequestOutput(success=True, ttft=0.1, latency=1.0, output_len=4)]  # no trace
    summary = trace_summary(outputs)
    assert (summary["traced_requests"], summary["kv_transfer_requests"], summary["kv_recompute_requests"]) == (4, 3, 1)
    assert summary["median_kv_transfer_ms"] == pytest.approx(20.0)
    assert summary["median_kv_transfer_bytes"] == 4096
    assert summary["median_kv_transfer_ttft_ratio"] == pytest.approx(0.05)  # of 0.02, 0.2 and 0.05
    arrays = per_request(outputs)
    assert arrays["traces"][4] is None and arrays["traces"][0][0]["spans"][1]["name"] == "kv.transfer"
    assert "traces" not in per_request(outputs[4:])
