"""One trace per request: where its time went, service by service, assembled at the proxy.

Every service records the stages of its part of a request and returns them with its answer (see
services/host/request_spans.py): the encoder with EncodeDone, prefill with PrefillDone, decode (or a unified
engine) with the request's first TokenDelta. The proxy adds its own spans - `proxy.request` (the whole
life, from the HTTP request to the last token), `proxy.encode` and `proxy.prefill` (each call as the proxy
waited for it, network and failover included) and `proxy.first_token` (until the first token reached the
OpenAI layer) - and, when the request ends:

- logs the breakdown at DEBUG, one line per request;
- observes each stage in `epdserve:request_stage_seconds{stage=...}`;
- exports it with OpenTelemetry when `--otlp-traces-endpoint` is set: one trace per request, its id
  derived from the request id (the same id finds the trace and the services' log lines), a root span
  `proxy.request` and every other span its child, attributes `epdserve.*` (and the served model's name as
  `gen_ai.response.model` on the root);
- with `--request-trace`, returns it to the client as the response's `epdserve_trace` field.

A span name may carry a detail after a colon (`kv.recompute:blocks_not_found`): the stage is the part
before it, the detail becomes the OpenTelemetry attribute `epdserve.reason`.

Span times are Unix seconds from each service's clock: on several hosts, their clocks' skew shows.
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
import time
from typing import Callable, Iterable

from epdserve.transport.channel.protocol import TraceSpan

logger = logging.getLogger(__name__)

REQUEST_SPAN = "proxy.request"


def stage_of(name: str) -> str:
    """A span name without its detail: `kv.recompute:no_room` -> `kv.recompute`."""
    return name.partition(":")[0]


def trace_id_of(request_id: str) -> int:
    """The OpenTelemetry trace id (128 bits, never 0) of a request id."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:16], "big") or 1


class RequestTrace:
    """One request's spans: the proxy's own and those the services returned. Built by the OpenAI layer
    as the request runs; `finish()` fixes its end."""

    def __init__(self, request_id: str, engine_id: str, start: float | None = None,
                 model_name: str | None = None) -> None:
        self.request_id = request_id
        self.engine_id = engine_id  # the proxy's, on its own spans
        self.model_name = model_name  # the served model's name, as the API and the metrics give it
        self.start = time.time() if start is None else start
        self.end: float | None = None
        self.error: str | None = None  # why the request failed, if it did
        self._spans: list[TraceSpan] = []
        self.closed = False  # logged, observed and exported (Tracer.close)

    def add(self, spans: Iterable[TraceSpan]) -> None:
        """Spans a service returned."""
        self._spans.extend(spans)

    def add_own(self, name: str, start: float, end: float | None = None) -> None:
        """A span of the proxy itself (Unix seconds; `end` defaults to now)."""
        self._spans.append(TraceSpan(name, self.engine_id, start, time.time() if end is None else end))

    def finish(self, error: str | None = None) -> None:
        """The request is over (or its last chunk is on its way): the first call fixes the end."""
        if self.end is None:
            self.end = time.time()
            self.error = error

    def spans(self) -> list[TraceSpan]:
        """`proxy.request` first, then every other span by start time."""
        end = self.end if self.end is not None else time.time()
        root = TraceSpan(REQUEST_SPAN, self.engine_id, self.start, end)
        return [root, *sorted(self._spans, key=lambda s: (s.start, s.end))]

    def breakdown(self) -> dict:
        """The trace as JSON (the `epdserve_trace` field): times in Unix seconds, durations in ms."""
        return {"request_id": self.request_id, "model": self.model_name,
                "spans": [{"name": s.name, "engine_id": s.engine_id, "start": s.start, "end": s.end,
                           "duration_ms": round((s.end - s.start) * 1000, 3), "num_bytes": s.num_bytes,
                           "num_blocks": s.num_blocks} for s in self.spans()]}

    def summary(self) -> str:
        """One line: each span's duration and where it ran, with the bytes it moved."""
        parts = []
        for s in self.spans():
            moved = f" {s.num_bytes}B/{s.num_blocks} blocks" if s.num_bytes or s.num_blocks else ""
            parts.append(f"{s.name} {(s.end - s.start) * 1000:.1f}ms@{s.engine_id}{moved}")
        return "; ".join(parts)


class Tracer:
    """Where finished traces go: the DEBUG log, the stage histogram, and an OpenTelemetry exporter if any."""

    def __init__(self, engine_id: str = "proxy", observe_stage: Callable[[str, float], None] | None = None,
                 export: OTelExport | None = None, model_name: str | None = None) -> None:
        self.engine_id = engine_id
        self.observe_stage = observe_stage
        self.export = export
        self.model_name = model_name  # every trace's model

    def new(self, request_id: str, start: float | None = None) -> RequestTrace:
        """The trace of a request that arrived at `start` (Unix seconds; default now)."""
        return RequestTrace(request_id, self.engine_id, start, self.model_name)

    def close(self, trace: RequestTrace, error: str | None = None) -> None:
        """The request is over: log, observe and export its trace, once."""
        if trace.closed:
            return
        trace.closed = True
        trace.finish(error)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s trace%s: %s", trace.request_id, f" (failed: {trace.error})" if trace.error else "",
                         trace.summary())
        if self.observe_stage is not None:
            for span in trace.spans():
                self.observe_stage(stage_of(span.name), span.end - span.start)
        if self.export is not None:
            try:
                self.export.export(trace)
            except Exception:  # a tracing backend's trouble must never fail a request
                logger.exception("request %s: exporting its trace failed", trace.request_id)

    def shutdown(self) -> None:
        if self.export is not None:
            self.export.shutdown()


def check_otlp_endpoint(endpoint: str) -> None:
    """ValueError unless `endpoint` is an http(s) URL and the OTLP/HTTP exporter is installed."""
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: expected an http(s) URL, e.g. "
                         "http://127.0.0.1:4318/v1/traces")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'epdserve[tracing]'") from None


# The trace id the next root span gets (see _RequestTraceIds).
_next_trace_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("epdserve_next_trace_id", default=None)


class OTelExport:
    """Exports traces with the OpenTelemetry SDK (the optional `tracing` extra, imported only here).

    `exporter`: any SDK SpanExporter; `OTelExport.otlp(url)` sends OTLP/HTTP protobuf to `url`
    (a collector's traces URL, e.g. http://127.0.0.1:4318/v1/traces). Spans leave in batches from the
    SDK's own thread, so a slow collector never holds a request up.
    """

    def __init__(self, exporter, service_name: str = "epdserve-proxy", batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       id_generator=_request_trace_ids())
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("epdserve")

    @classmethod
    def otlp(cls, endpoint: str, service_name: str = "epdserve-proxy") -> OTelExport:
        check_otlp_endpoint(endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint), service_name)

    def export(self, trace: RequestTrace) -> None:
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        root_span, *spans = trace.spans()
        token = _next_trace_id.set(trace_id_of(trace.request_id))
        try:
            attributes = _attributes(root_span, trace.request_id)
            if trace.model_name:  # OpenTelemetry's GenAI convention, as vLLM's traces carry it
                attributes["gen_ai.response.model"] = trace.model_name
            root = self.tracer.start_span(REQUEST_SPAN, start_time=_ns(root_span.start), attributes=attributes)
        finally:
            _next_trace_id.reset(token)
        context = set_span_in_context(root)
        for span in spans:
            child = self.tracer.start_span(stage_of(span.name), context=context, start_time=_ns(span.start),
                                           attributes=_attributes(span, trace.request_id))
            child.end(end_time=_ns(span.end))
        if trace.error:
            root.set_status(Status(StatusCode.ERROR, trace.error))
        root.end(end_time=_ns(root_span.end))

    def force_flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


def _request_trace_ids():
    """An SDK id generator whose root spans take the trace id set in `_next_trace_id` (derived from the
    request id), random ids otherwise."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RequestTraceIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            return _next_trace_id.get() or super().generate_trace_id()

    return RequestTraceIds()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _attributes(span: TraceSpan, request_id: str) -> dict:
    attributes = {"epdserve.request_id": request_id, "epdserve.engine_id": span.engine_id}
    if span.num_bytes or span.num_blocks:
        attributes |= {"epdserve.num_bytes": span.num_bytes, "epdserve.num_blocks": span.num_blocks}
    reason = span.name.partition(":")[2]
    if reason:
        attributes["epdserve.reason"] = reason
    return attributes
