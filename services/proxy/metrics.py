"""Prometheus metrics of the proxy, named like vLLM's (`vllm:` becomes `epdserve:`)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class ProxyMetrics:
    """One registry per proxy (not the global one), so in-process tests and apps do not collide."""

    def __init__(self, model_name: str, rejected_frames: Callable[[], int] | None = None) -> None:
        """`rejected_frames()`: how many frames the proxy's inbox has dropped (malformed, oversized, unknown)."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("epdserve:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("epdserve:inter_token_latency_seconds", "Time between generated tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("epdserve:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("epdserve:request_success", "Finished requests by reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._failure = Counter("epdserve:request_failure", "Requests that failed, by HTTP status.",
                                labels + ["status"], registry=self.registry)
        self.prompt_tokens = Counter("epdserve:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry).labels(model_name)
        self.cached_prompt_tokens = Counter("epdserve:prompt_tokens_cached",
                                            "Prompt tokens served from a prefix cache.", labels,
                                            registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("epdserve:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry).labels(model_name)
        self._aborts = Counter("epdserve:request_aborts", "Requests aborted before they finished, by reason.",
                               labels + ["reason"], registry=self.registry)
        if rejected_frames is not None:
            self.registry.register(_ReadAtScrape("epdserve:inbox_rejected_frames",
                                                 "Frames the proxy's inbox dropped as malformed, oversized or "
                                                 "unknown.", model_name, rejected_frames))
        self.running = Gauge("epdserve:num_requests_running", "Requests in flight at this proxy.", labels,
                             registry=self.registry).labels(model_name)
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def failed(self, status: int) -> None:
        self._failure.labels(self.model_name, str(status)).inc()

    def aborted(self, reason: str) -> None:
        self._aborts.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ReadAtScrape:
    """A counter kept elsewhere, read when scraped."""

    def __init__(self, name: str, documentation: str, model_name: str, read: Callable[[], int]) -> None:
        self.name, self.documentation, self.model_name, self.read = name, documentation, model_name, read

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], self.read())
        yield family
