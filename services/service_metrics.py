"""Prometheus metrics of a service, named like vLLM's (`vllm:` becomes `epdserve:`).

Engine state (running/waiting, KV usage, prefix-cache queries and hits, preemptions) is read from the
engine when scraped; what the service itself does (transfers, leases, fallbacks, rejected frames) is
counted as it happens.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epdserve.shared.engine import EngineStats
from epdserve.shared.outputs import RequestOutput

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, labels: dict[str, str], stats: Callable[[], EngineStats] | None,
                 extra: Callable[[], dict]) -> None:
        self.labels, self.stats, self.extra = labels, stats, extra

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

        for name, (doc, value) in self.extra().items():
            yield counter(name, doc, value)
        if self.stats is None:
            return
        s = self.stats()
        yield gauge("epdserve:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("epdserve:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("epdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_cache_usage)
        yield gauge("epdserve:num_free_kv_blocks", "Free KV blocks.", s.num_free_blocks)
        yield counter("epdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("epdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("epdserve:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions)
        steps = CounterMetricFamily("epdserve:engine_step_seconds", "Engine step time by phase (schedule, prepare, "
                                    "forward, attention, sampler, output).", labels=names + ["phase"])
        for phase, seconds in s.step_seconds.items():
            steps.add_metric(values + [phase], seconds)
        yield steps
        yield counter("epdserve:engine_steps", "Engine steps run.", s.num_steps)
        finished = CounterMetricFamily("epdserve:request_success", "Requests this engine finished, by reason (a "
                                       "prefill engine's part ends at the first token).", labels=names + ["finished_reason"])
        for reason, count in s.num_finished.items():
            finished.add_metric(values + [reason], count)
        yield finished


class ServiceMetrics:
    def __init__(self, role: str, engine_id: str, stats: Callable[[], EngineStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"role": role, "engine_id": engine_id}
        # Frames the control channel dropped; set by the service runtime.
        self.rejected_frames: Callable[[], int] = lambda: 0
        self.registry.register(_EngineCollector(self.labels, stats, self._extra))
        names = list(self.labels)

        def counter(name: str, doc: str, extra: list[str] = ()):
            c = Counter(name, doc, names + list(extra), registry=self.registry)
            return c if extra else c.labels(**self.labels)

        self.queue_time = Histogram("epdserve:request_queue_time_seconds", "Arrival to first scheduling.", names,
                                    buckets=_BUCKETS, registry=self.registry).labels(**self.labels)
        self.transfer_bytes = counter("epdserve:kv_transfer_bytes", "Bytes of KV blocks and embeddings moved.")
        self.transfer_seconds = counter("epdserve:kv_transfer_seconds", "Seconds spent moving KV and embeddings.")
        self.transfer_failures = counter("epdserve:kv_transfer_failures", "Transfers that failed.")
        self.remote_kv_requests = counter("epdserve:remote_kv_requests", "Requests decoded on KV pulled from prefill.")
        self.remote_kv_blocks = counter("epdserve:remote_kv_blocks", "KV blocks pulled from prefill.")
        self.local_kv_hit_blocks = counter("epdserve:remote_kv_local_hit_blocks",
                                           "Prompt blocks decode found in its own prefix cache instead of pulling.")
        self.local_prefills = counter("epdserve:local_prefills",
                                      "Requests prefilled by this engine itself (unified, or decode's fallback).")
        self.expired_leases = counter("epdserve:kv_lease_expired", "Held KV released because its lease ran out.")
        self.lease_renewals = counter("epdserve:kv_lease_renewals",
                                      "Leases on prefill's KV renewed while a request waited here for room.")
        self.embeddings_fetched = counter("epdserve:embeddings_fetched", "Image embeddings pulled from encoders.")

    def _extra(self) -> dict:
        return {"epdserve:rejected_frames": ("Control frames dropped as malformed, oversized or unknown.",
                                             self.rejected_frames())}

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
