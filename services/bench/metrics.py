"""What the client saw of each request, and the serving metrics computed from it.

Definitions follow `vllm bench serve` so numbers and JSON fields compare one to one:

- TTFT: request sent -> first token chunk received.
- ITL: gaps between consecutive token chunks of one request (a chunk may carry several tokens).
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one output token.
- E2EL ("latency"): request sent -> last chunk received.
- Client queue time: request due -> sent, the wait for a slot under a concurrency cap; with a cap its
  percentiles can be reported (`client_queue_time`), and at a finite rate those of E2EL plus that wait
  (`e2el_including_client_queue`), as vLLM reports them.
- Goodput: completed requests per second whose TTFT, TPOT and E2EL are all within the given SLOs
  (a request with at most one output token counts TPOT as 0).

Times are seconds in `RequestOutput`; every reported statistic is in milliseconds. Percentiles are
numpy's linear interpolation; an empty sample reports 0, as vLLM does.

With `--trace` (an epdserve proxy run with --request-trace), each request also keeps the server's
breakdown of it (`epdserve_trace`: spans of the proxy, prefill, KV transfer, decode...), and the summary
says what the KV transfer cost: over the requests that pulled KV, the median transfer time and bytes, and
the median of each request's transfer time over its TTFT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestOutput:
    """One request as the client saw it (perf_counter seconds). The runner fills it; nothing else writes."""

    success: bool = False
    prompt_len: int = 0  # server-reported prompt tokens when the response had usage, else the dataset's count
    output_len: int = 0  # server-reported completion tokens, else the tokenizer's count, else token chunks
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0  # due -> sent: waiting for a slot under the concurrency cap
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    turn: int | None = None  # multi-turn conversations: 0 for a conversation's first request
    generated_text: str = ""
    error: str = ""
    # The server's breakdown (`epdserve_trace`: one trace per prompt, each {"request_id", "spans"}), if sent.
    trace: list[dict] | None = None

    @property
    def tpot(self) -> float:
        if self.output_len <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile_key(p: float) -> str:
    """50 -> "p50", 99.9 -> "p99.9" (vLLM's naming)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def distribution(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/p* of `values_s` (seconds) as `<stat>_<name>_ms` fields."""
    data = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(data.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p))
    return out


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError on bad input."""
    slo: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {pair!r}: expected NAME:MILLISECONDS with NAME one of {SLO_METRICS}")
        ms = float(value)
        if not ms >= 0:
            raise ValueError(f"goodput SLO {pair!r}: the value must be a non-negative number of milliseconds")
        slo[name] = ms
    return slo


def is_good(output: RequestOutput, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (milliseconds)."""
    values = {"ttft": output.ttft, "tpot": output.tpot, "e2el": output.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def token_times(output: RequestOutput) -> list[float]:
    """Arrival time of each token chunk: start + TTFT, then each ITL gap."""
    times = [output.start_time + output.ttft]
    for gap in output.itl:
        times.append(times[-1] + gap)
    return times


def peak_output_rate(outputs: list[RequestOutput]) -> tuple[float, int]:
    """(max output tokens in any one-second bucket from the first start, peak concurrent requests).

    Tokens are spread evenly over a request's chunks: a chunk carrying several tokens counts them all.
    """
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    t1 = max(o.start_time + o.latency for o in done)
    buckets = np.zeros(int(math.ceil(t1 - t0)) + 1)
    events: list[tuple[float, int]] = []
    for o in done:
        times = token_times(o)
        per_chunk = o.output_len / len(times) if times else 0.0
        for t in times:
            buckets[min(int(t - t0), len(buckets) - 1)] += per_chunk
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    events.sort()  # at a tie an end (-1) sorts before a start: half-open intervals
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return float(buckets.max()), peak


def summarize(outputs: list[RequestOutput], duration_s: float, percentiles: list[float],
              percentile_metrics: tuple[str, ...] | list[str] = DEFAULT_PERCENTILE_METRICS,
              goodput_slo_ms: dict[str, float] | None = None) -> dict:
    """The aggregate fields of a `vllm bench serve` result, plus cached-token and later-turn extras."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_len for o in done)
    peak_tokens, peak_requests = peak_output_rate(outputs)
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (sum(is_good(o, goodput_slo_ms) for o in done) / duration_s) if goodput_slo_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "total_cached_tokens": sum(o.cached_tokens or 0 for o in done),
    }
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [o.tpot for o in done if o.output_len > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
        "client_queue_time": [o.queue_time for o in done],
        "e2el_including_client_queue": [o.latency + o.queue_time for o in done],
    }
    for name in percentile_metrics:
        result |= distribution(name, samples[name], percentiles)
    later = [o.ttft for o in done if o.turn is not None and o.turn > 0]
    if later:  # multi-turn: what a prefix cache changes is the TTFT of every turn after the first
        result |= distribution("later_turns_ttft", later, percentiles)
    return result


def per_request(outputs: list[RequestOutput], with_texts: bool = False) -> dict[str, list]:
    """The per-request arrays of a `vllm bench serve` result (index i is the i-th request of the dataset)."""
    arrays = {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "tpots": [o.tpot for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "errors": [o.error for o in outputs],
    }
    if any(o.turn is not None for o in outputs):
        arrays["turns"] = [o.turn for o in outputs]
    if with_texts:
        arrays["generated_texts"] = [o.generated_text for o in outputs]
    if any(o.trace is not None for o in outputs):
        arrays["traces"] = [o.trace for o in outputs]
    return arrays


def kv_transfer(output: RequestOutput) -> tuple[float, int] | None:
    """(seconds, bytes) of a request's KV pulls (its `kv.transfer` spans), or None if it pulled none."""
    spans = [span for trace in output.trace or () for span in trace.get("spans", ()) if span["name"] == "kv.transfer"]
    if not spans:
        return None
    return sum(span["end"] - span["start"] for span in spans), sum(span["num_bytes"] for span in spans)


def trace_summary(outputs: list[RequestOutput]) -> dict:
    """What the server's traces say about the KV transfer, over the completed requests that sent one."""
    traced = [o for o in outputs if o.success and o.trace]
    pulls = [(o, pulled) for o in traced if (pulled := kv_transfer(o)) is not None]
    recomputes = sum(any(span["name"].startswith("kv.recompute") for trace in o.trace for span in trace["spans"])
                     for o in traced)
    median = lambda values: float(np.median(values)) if values else 0.0  # noqa: E731
    return {
        "traced_requests": len(traced),
        "kv_transfer_requests": len(pulls),
        "kv_recompute_requests": recomputes,
        "median_kv_transfer_ms": median([seconds * 1000.0 for _, (seconds, _) in pulls]),
        "median_kv_transfer_bytes": median([num_bytes for _, (_, num_bytes) in pulls]),
        "median_kv_transfer_ttft_ratio": median([seconds / o.ttft for o, (seconds, _) in pulls if o.ttft > 0]),
    }
