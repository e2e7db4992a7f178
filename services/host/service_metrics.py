"""Prometheus metrics of a service: vLLM's series under vLLM's names (`vllm:`), with vLLM's labels, meaning and
buckets, so that vLLM's Grafana dashboards and alerts work unchanged; what vLLM has no series for is ours
(`epdserve:`).

Every series carries vLLM's `model_name` (as the proxy's: `--served-model-name`, else the model folder's
name) and `engine` (the engine's index in its server, as vLLM's: a service runs one engine, "0"), and ours:
`role` and `engine_id`.

Who counts what, so that a sum over every target counts each request once:
    the proxy    requests: `request_success_total` (the request count, by finish reason), TTFT, ITL, TPOT,
                 e2e latency, prompt, generation and cached prompt tokens, request lengths and parameters
    engines      their batch and cache: running/waiting, KV usage, preemptions, `iteration_tokens_total`,
                 speculative decoding's drafts and accepted tokens (`spec_decode_*`); the prompts they
                 prefill: prefix-cache and KV tier (`external_prefix_cache_*`) lookups and hits, prompt
                 tokens by source; and each request's queue, prefill, decode and inference time
    encoders     `mm_cache_queries_total` / `mm_cache_hits_total` (images looked up, images found)
A request is looked up in a prefix cache by the engine that prefills it - the prefill, or the decode or
unified engine that computes its prompt itself - and only there: a decode continuing after prefill's first
token (it looks the prompt up in its own cache to pull less) or after a lost stream does not count it
(shared/engine/prompt_stats.py). Likewise each request is observed once in each of the time histograms:
queue and prefill time by the engine that prefilled it, decode and inference time by the engine it ended on
(a request that ends at its first token: the prefill; otherwise the decode or unified engine, timing its
part there). `epdserve:engine_requests_finished_total` is each engine's share of the requests (a request
served by prefill and decode ends once on each); `epdserve:prompt_tokens_computed_total` is the work each
engine did, recomputations included.
Engine state is read from the engine when scraped; what the service itself does (transfers, leases,
fallbacks, rejected frames) is counted as it happens.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from epdserve.shared.engine import RESTORE_SECONDS_BUCKETS, EngineStats, RequestOutput

disable_created_metrics()  # no `_created` series beside every counter and histogram, as in vLLM

# vLLM's `engine` label: the index of the engine in its server. A service runs one engine.
ENGINE_INDEX = "0"
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for a request's queue, prefill, decode, inference and end-to-end time.
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A request's KV pull: 64 KiB to 16 GiB, by factors of 4.
TRANSFER_BYTE_BUCKETS = tuple(float(1 << b) for b in range(16, 35, 2))


class _EngineCollector:
    def __init__(self, labels: dict[str, str], stats: Callable[[], EngineStats] | None,
                 extra: Callable[[], dict], requests: Callable[[], tuple[int, int]] | None = None) -> None:
        self.labels, self.stats, self.extra, self.requests = labels, stats, extra, requests

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def by(family, label, doc, counts: dict, kind=CounterMetricFamily):
            f = kind(family, doc, labels=names + [label])
            for key, count in counts.items():
                f.add_metric(values + [key], count)
            return f

        for name, (doc, value) in self.extra().items():
            yield counter(name, doc, value)
        if self.stats is None:
            if self.requests is not None:  # a service without an engine (an encoder): its own two counts
                running, waiting = self.requests()
                yield gauge("vllm:num_requests_running", "Requests being worked on.", running)
                yield gauge("vllm:num_requests_waiting", "Requests waiting for their turn.", waiting)
            return
        s = self.stats()
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        # As vLLM's: those held back while their KV (or image embeddings) is loaded wait too, "deferred".
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled, or held back while their KV "
                    "is loaded.", s.num_waiting + s.num_waiting_for_kv)
        yield by("vllm:num_requests_waiting_by_reason", "reason", "Waiting requests by reason: capacity (in the "
                 "queue, for KV blocks or a seat) or deferred (while a connector loads their KV or image "
                 "embeddings).", {"capacity": s.num_waiting, "deferred": s.num_waiting_for_kv}, GaugeMetricFamily)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_cache_usage)
        yield gauge("epdserve:num_free_kv_blocks", "Free KV blocks.", s.num_free_blocks)
        yield gauge("epdserve:num_kv_blocks", "KV blocks in the pool.", s.num_total_blocks)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens: the tokens of each request "
                      "this engine prefilled, looked up once.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens: of those, found in this engine's "
                      "prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries", "KV tier queries (the local offload tier, the shared "
                      "KV store), in tokens: the same tokens, looked up in the tiers too.",
                      s.external_prefix_cache_queries)
        yield counter("vllm:external_prefix_cache_hits", "KV tier hits, in tokens: of those, restored from a tier "
                      "instead of computed.", s.external_prefix_cache_hits)
        yield by("vllm:prompt_tokens_by_source", "source", "Prompt tokens of the requests this engine prefilled, "
                 "by source: local_compute, local_cache_hit (its prefix cache), external_kv_transfer (a KV tier).",
                 s.prompt_tokens_by_source)
        yield counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions)
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode, counter, names, values)
        yield counter("epdserve:prompt_tokens_computed", "Prompt tokens this engine computed (not those found in "
                      "its prefix cache, pulled from a peer or restored from a KV tier), recomputations included.",
                      s.num_prompt_tokens)
        steps = CounterMetricFamily("epdserve:engine_step_seconds", "Engine step time by phase (schedule, draft, "
                                    "prepare, forward, attention, sampler, output; with --profile-moe a mixture of "
                                    "experts' moe_route, moe_dispatch, moe_experts, moe_combine too).",
                                    labels=names + ["phase"])
        for phase, seconds in s.step_seconds.items():
            steps.add_metric(values + [phase], seconds)
        yield steps
        yield counter("epdserve:engine_steps", "Engine steps run.", s.num_steps)
        yield by("epdserve:engine_requests_finished", "finished_reason", "Requests this engine finished, by reason "
                 "(a prefill engine's part ends at the first token). The request count is the proxy's "
                 "vllm:request_success.", s.num_finished)
        if s.kv_tiers:
            yield from self._tiers(s, names, values)

    @staticmethod
    def _tiers(s: EngineStats, names: list[str], values: list[str]):
        """The KV tiers beyond the pool, by `tier` (local: the offload tier)."""
        labels = names + ["tier"]
        for kind, name, doc, field in _TIER_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
            for tier, stats in s.kv_tiers.items():
                family.add_metric(values + [tier], getattr(stats, field))
            yield family
        restore = HistogramMetricFamily("epdserve:kv_tier_restore_seconds",
                                        "Time of one load from a KV tier into the pool, start to finish.",
                                        labels=labels)
        for tier, stats in s.kv_tiers.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*RESTORE_SECONDS_BUCKETS, float("inf")), stats.restore_buckets):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
            restore.add_metric(values + [tier], buckets, stats.restore_seconds)
        yield restore

    @staticmethod
    def _spec_decode(sd, counter, names: list[str], values: list[str]):
        """Speculative decoding's counters; acceptance rate = accepted / draft tokens, mean accepted length =
        1 + accepted / drafts (as vLLM's dashboards compute them)."""
        yield counter("vllm:spec_decode_num_drafts", "Speculative decoding: verification runs (one "
                      "request's draft tokens in one step).", sd.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
                      sd.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                      sd.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: draft tokens accepted, by position in the draft.",
                                      labels=names + ["position"])
        for position, count in enumerate(sd.num_accepted_tokens_per_pos):
            per_pos.add_metric(values + [str(position)], count)
        yield per_pos

_TIER_SERIES = (
    ("gauge", "epdserve:kv_tier_blocks", "KV blocks a tier holds.", "num_blocks"),
    ("gauge", "epdserve:kv_tier_capacity_blocks", "KV blocks a tier can hold.", "capacity_blocks"),
    ("counter", "epdserve:kv_tier_hit_blocks", "KV blocks restored from a tier instead of computed.", "hit_blocks"),
    ("counter", "epdserve:kv_tier_hit_tokens", "Prompt tokens restored from a tier instead of computed.",
     "hit_tokens"),
    ("counter", "epdserve:kv_tier_restored_bytes", "Bytes of KV restored from a tier.", "restored_bytes"),
    ("counter", "epdserve:kv_tier_saved_blocks", "KV blocks saved to a tier.", "saved_blocks"),
    ("counter", "epdserve:kv_tier_saved_bytes", "Bytes of KV saved to a tier.", "saved_bytes"),
    ("counter", "epdserve:kv_tier_dropped_saves", "Evicted KV blocks a tier did not save (its staging was full).",
     "dropped_saves"),
    ("counter", "epdserve:kv_tier_failed_restores",
     "Loads from a tier that failed (a block's checksum differed, or it was gone): those tokens were computed.",
     "failed_restores"),
    ("counter", "epdserve:kv_tier_corrupt_blocks", "Blocks in a tier whose bytes no longer matched their checksum.",
     "corrupt_blocks"),
)


class ServiceMetrics:
    def __init__(self, role: str, engine_id: str, model_name: str, stats: Callable[[], EngineStats] | None = None,
                 mm_cache: Callable[[], tuple[int, int]] | None = None,
                 rejected_frames: Callable[[], int] = lambda: 0,
                 requests: Callable[[], tuple[int, int]] | None = None) -> None:
        """`stats()`: the engine's state (engines); `mm_cache()`: (images looked up, images found) (encoders);
        `rejected_frames()`: frames the service's channels dropped (malformed, oversized, unknown); `requests()`:
        (running, waiting) where there is no engine's state (encoders: what tells a retiring one idle)."""
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": ENGINE_INDEX, "role": role, "engine_id": engine_id}
        self.role = role
        self.rejected_frames = rejected_frames
        self.mm_cache = mm_cache
        self.registry.register(_EngineCollector(self.labels, stats, self._extra, requests))
        names = list(self.labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=self.registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets=REQUEST_TIME_BUCKETS):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Arrival to first scheduling, for requests this engine prefilled.")
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduling to first token, for requests this engine prefilled.")
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "First token to last, for requests that ended on this engine (continued "
                                     "from a prefill's first token: from their arrival here with it).")
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time a request that ended on this engine ran here: first scheduling (or, "
                                        "for a request prefilled elsewhere, its arrival with the first token) to "
                                        "its last token.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.transfer_bytes = counter("epdserve:kv_transfer_bytes", "Bytes of KV blocks and embeddings moved.")
        self.transfer_seconds = counter("epdserve:kv_transfer_seconds", "Seconds spent moving KV and embeddings.")
        # Per request, beside the totals above (which also count embeddings): the counters' names are
        # taken, hence `request_` as the other per-request histograms.
        self.request_transfer_seconds = histogram("epdserve:request_kv_transfer_seconds",
                                                  "Time of one request's KV pull from prefill.", _BUCKETS)
        self.request_transfer_bytes = histogram("epdserve:request_kv_transfer_bytes",
                                                "Bytes of one request's KV pull from prefill.", TRANSFER_BYTE_BUCKETS)
        self.transfer_failures = counter("epdserve:kv_transfer_failures", "Transfers that failed.")
        integrity = Counter("epdserve:transfer_integrity_failures",
                            "Fetches whose bytes landed corrupted (checksums differ from the sender's), by kind: "
                            "kv (KV blocks) or embeddings. Each is fetched once more; a second one recomputes "
                            "the prompt (kv) or fails the request (embeddings).",
                            names + ["kind"], registry=self.registry)
        self.integrity_failures = {kind: integrity.labels(**self.labels, kind=kind) for kind in ("kv", "embeddings")}
        self.remote_kv_requests = counter("epdserve:remote_kv_requests", "Requests decoded on KV pulled from prefill.")
        self.remote_kv_blocks = counter("epdserve:remote_kv_blocks", "KV blocks pulled from prefill.")
        self.local_kv_hit_blocks = counter("epdserve:remote_kv_local_hit_blocks",
                                           "Prompt blocks decode found in its own prefix cache instead of pulling.")
        self.local_prefills = counter("epdserve:local_prefills",
                                      "Prompts this engine computed: a prefill's, a unified or decode engine's "
                                      "own, a decode's recompute when its pull failed (that request counted on "
                                      "prefill too), a stream continued here after its instance was lost.")
        self.expired_leases = counter("epdserve:kv_lease_expired", "Held KV released because its lease ran out.")
        self.lease_renewals = counter("epdserve:kv_lease_renewals",
                                      "Leases on prefill's KV renewed while a request waited here for its pull.")
        self.embeddings_fetched = counter("epdserve:embeddings_fetched", "Image embeddings pulled from encoders.")
        self.embeddings_unavailable = counter("epdserve:embeddings_unavailable",
                                              "Requests failed because their image embeddings could not be had "
                                              "from the encoder that made them (gone, unreachable, corrupted twice): "
                                              "answered as retryable, the proxy encodes the image again.")
        self.refused_overloaded = counter("epdserve:requests_refused_overloaded",
                                          "Requests refused because the prompts queued ahead would take longer "
                                          "than --max-queue-wait (admission control).")

    def _extra(self) -> dict:
        extra = {"epdserve:rejected_frames": ("Control frames dropped as malformed, oversized or unknown.",
                                              self.rejected_frames())}
        if self.mm_cache is not None:
            queries, hits = self.mm_cache()
            extra["vllm:mm_cache_queries"] = ("Multimodal cache queries, in items: images looked up in the "
                                              "encoder cache.", queries)
            extra["vllm:mm_cache_hits"] = ("Multimodal cache hits, in items: images found in the encoder cache "
                                           "(not encoded again).", hits)
        return extra

    def finished(self, out: RequestOutput, ends_here: bool = True) -> None:
        """A request's part on this engine is over (for prefill: at its first token); `ends_here`: the request
        ends with it (a prefill's: when its first token is its last). Queue and prefill time are observed by
        the engine that prefilled the request, decode and inference time by the one it ended on: once each."""
        m = out.metrics
        if m is None:
            return
        scheduled, first_token, end = m.first_scheduled_time, m.first_token_time, m.finished_time
        if scheduled is not None and not m.peer_prefilled:
            self.queue_time.observe(scheduled - m.arrival_time)
            if first_token is not None:
                self.prefill_time.observe(first_token - scheduled)
        if not ends_here or end is None:
            return
        start = scheduled if scheduled is not None else first_token
        if start is not None:
            self.inference_time.observe(end - start)
        if first_token is not None:
            self.decode_time.observe(end - first_token)
