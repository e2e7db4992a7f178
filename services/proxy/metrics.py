"""Prometheus metrics of the proxy: vLLM's request-level series under vLLM's names (`vllm:`), labels (the
proxy runs no engine: `model_name` only) and buckets; its own (`epdserve:`) where vLLM has none.

The proxy sees every request once, whichever engines served it (and however often it failed over), so
its series are the request-level ones: `vllm:request_success_total` is the request count (engines report
their share as `epdserve:engine_requests_finished_total`), with TTFT, ITL, TPOT and end-to-end latency as
the client saw them, prompt, generation and cached prompt tokens (as the response's usage counts them),
request lengths and parameters, and the requests in flight here (`epdserve:proxy_requests_in_flight`: the
engines' `vllm:num_requests_running`/`waiting` count the same requests).
`http_responses_total` counts every API response by status, errors refused before any engine was involved
included; probes and scrapes of /health, /ready and /metrics are not API traffic and are not counted.
`request_stage_seconds` breaks requests down by stage (`stage`: a span name of their traces, see
tracing.py). See services/host/service_metrics.py for the engines' series.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.shared.engine import SamplingParams

disable_created_metrics()  # no `_created` series beside every counter and histogram, as in vLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
# vLLM's buckets: time to first token; inter-token latency and time per output token; a request's end to end.
_TTFT_BUCKETS = (*_LATENCY_BUCKETS, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int | None) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to the model's length (None: a million)."""
    top = 1_000_000 if max_model_len is None else max_model_len
    return tuple(m * 10 ** e for e in range(len(str(top))) for m in (1, 2, 5) if m * 10 ** e <= top)


class ProxyMetrics:
    """One registry per proxy (not the global one), so in-process tests and apps do not collide."""

    def __init__(self, model_name: str, rejected_frames: Callable[[], int] | None = None,
                 max_model_len: int | None = None) -> None:
        """`rejected_frames()`: how many frames the proxy's inbox has dropped (malformed, oversized, unknown);
        `max_model_len`: the model's length, where the token-count buckets stop."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        tokens = token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", _TPOT_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "A finished request's mean time per output token after the first (0 for a "
                              "single token).", _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt length of finished "
                                               "requests, in tokens.", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated for finished requests.", tokens)
        self.request_max_num_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                                           "Tokens generated for the longest sequence of finished "
                                                           "requests (n > 1: of their n sequences).", tokens)
        self.request_params_n = histogram("vllm:request_params_n", "The n parameter of finished requests.",
                                          _N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "The max_tokens of finished requests (the room left in the "
                                                   "model's length when not given).", tokens)
        self._success = Counter("vllm:request_success", "Finished requests by reason: the request count.",
                                labels + ["finished_reason"], registry=self.registry)
        self._failure = Counter("epdserve:request_failure", "Requests that failed, by HTTP status.",
                                labels + ["status"], registry=self.registry)
        self._responses = Counter("epdserve:http_responses", "HTTP responses by status.", labels + ["status"],
                                  registry=self.registry)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_prompt_tokens = counter("vllm:prompt_tokens_cached", "Prompt tokens of finished requests not "
                                            "computed for them: found in a prefix cache or restored from a KV "
                                            "tier (the usage's cached_tokens).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self._aborts = Counter("epdserve:request_aborts", "Requests aborted before they finished, by reason.",
                               labels + ["reason"], registry=self.registry)
        self._migrations = Counter("epdserve:request_migrations", "Streams continued on another instance after "
                                   "theirs was lost, by reason (instance_lost, drained, tokens_lost).",
                                   labels + ["reason"], registry=self.registry)
        self._reencodes = counter("epdserve:request_reencodes", "Requests whose images were encoded again because an "
                                  "engine could not have their embeddings from the encoder that made them "
                                  "(gone, unreachable), then sent once more.")
        self._routes = Counter("epdserve:routing_decisions", "Where requests were sent (path: prefill_decode, "
                               "decode_only, unified) and why (reason).", labels + ["path", "reason"],
                               registry=self.registry)
        if rejected_frames is not None:
            self.registry.register(_ReadAtScrape("epdserve:inbox_rejected_frames",
                                                 "Frames the proxy's inbox dropped as malformed, oversized or "
                                                 "unknown.", model_name, rejected_frames))
        self._stages = Histogram("epdserve:request_stage_seconds", "Time requests spent in each stage of their "
                                 "traces (proxy.request, prefill.queue, kv.transfer, ...), one observation per "
                                 "span.", labels + ["stage"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        # Not `vllm:num_requests_running`: the engines' gauges of that name count these same requests, and a
        # dashboard's sum over every target (vLLM's `sum(vllm:num_requests_running)`) would count them twice.
        self.in_flight = Gauge("epdserve:proxy_requests_in_flight", "Requests in flight at this proxy (each also "
                               "counted by the engine running it, in num_requests_running or num_requests_waiting).",
                               labels, registry=self.registry).labels(model_name)
        self.model_name = model_name

    def finished(self, reason: str, num_prompt_tokens: int, num_cached_tokens: int, num_generated_tokens: int,
                 params: SamplingParams, e2e_seconds: float, ttft_seconds: float | None,
                 longest_sequence_tokens: int | None = None) -> None:
        """A request ended with a finish reason (not an error): everything counted once per request.
        `num_generated_tokens`: over its sequences; `longest_sequence_tokens`: its longest one's (default: the
        same, one sequence), which its end to end latency and time per output token are the time of."""
        longest = num_generated_tokens if longest_sequence_tokens is None else longest_sequence_tokens
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated_tokens)
        self.request_max_num_generation_tokens.observe(longest)
        self.request_params_n.observe(params.n)
        if params.max_tokens is not None:
            self.request_params_max_tokens.observe(params.max_tokens)
        if ttft_seconds is not None:
            self.tpot.observe((e2e_seconds - ttft_seconds) / (longest - 1) if longest > 1 else 0.0)

    def failed(self, status: int) -> None:
        self._failure.labels(self.model_name, str(status)).inc()

    def responded(self, status: int) -> None:
        self._responses.labels(self.model_name, str(status)).inc()

    def aborted(self, reason: str) -> None:
        self._aborts.labels(self.model_name, reason).inc()

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._stages.labels(self.model_name, stage).observe(seconds)

    def routed(self, path: str, reason: str) -> None:
        self._routes.labels(self.model_name, path, reason).inc()

    def migrated(self, reason: str) -> None:
        self._migrations.labels(self.model_name, reason).inc()

    def reencoded(self) -> None:
        self._reencodes.inc()

    def watch_prefix_index(self, index: PrefixIndex) -> None:
        """Export what the KV-aware router knows: blocks indexed per instance, resyncs, memory."""
        self.registry.register(_PrefixIndexCollector(self.model_name, index))

    def watch_prompt_queues(self, instances: Callable[[], Iterable]) -> None:
        """Export each instance's prompt queue as this proxy sees it (router.Instance.queued_prompt_tokens)."""
        self.registry.register(_PromptQueueCollector(self.model_name, instances))

    def watch_planner(self, desired: Callable[[], dict[str, int]]) -> None:
        """Export the replicas a planner wants of each role (a discovery file's planner.desired)."""
        self.registry.register(_PlannerCollector(self.model_name, desired))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixIndexCollector:
    def __init__(self, model_name: str, index: PrefixIndex) -> None:
        self.model_name, self.index = model_name, index

    def collect(self):
        blocks = GaugeMetricFamily("epdserve:kv_index_blocks", "Cached blocks the router knows each instance holds "
                                   "(from its KV events).", labels=["model_name", "instance"])
        for instance, num in self.index.blocks_per_instance().items():
            blocks.add_metric([self.model_name, instance], num)
        yield blocks
        resyncs = CounterMetricFamily("epdserve:kv_index_resyncs", "KV event batches that did not follow the last "
                                      "one applied (lost, or the instance restarted): a snapshot was asked for.",
                                      labels=["model_name"])
        resyncs.add_metric([self.model_name], self.index.num_resyncs)
        yield resyncs


class _PromptQueueCollector:
    def __init__(self, model_name: str, instances: Callable[[], Iterable]) -> None:
        self.model_name, self.instances = model_name, instances

    def collect(self):
        queued = GaugeMetricFamily("epdserve:queued_prompt_tokens", "Prompt tokens this proxy has sent each "
                                   "instance to prefill and has no first token for.",
                                   labels=["model_name", "role", "instance"])
        for instance in self.instances():
            queued.add_metric([self.model_name, instance.role.value, instance.address], instance.queued_prompt_tokens)
        yield queued


class _PlannerCollector:
    def __init__(self, model_name: str, desired: Callable[[], dict[str, int]]) -> None:
        self.model_name, self.desired = model_name, desired

    def collect(self):
        family = GaugeMetricFamily("epdserve:planner_desired_replicas", "Instances the planner wants of each role.",
                                   labels=["model_name", "role"])
        for role, replicas in sorted(self.desired().items()):
            family.add_metric([self.model_name, role], replicas)
        yield family


class _ReadAtScrape:
    """A counter kept elsewhere, read when scraped."""

    def __init__(self, name: str, documentation: str, model_name: str, read: Callable[[], int]) -> None:
        self.name, self.documentation, self.model_name, self.read = name, documentation, model_name, read

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], self.read())
        yield family
