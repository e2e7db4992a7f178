"""The spans one service records for one request: the stages of its part (queue, compute, KV pull...).

They go back with the request's answer - `EncodeDone.trace`, `PrefillDone.trace`, or the request's first
`TokenDelta.trace` - and the proxy assembles every service's spans into the request's trace
(services/proxy/tracing.py). Recording costs a few objects per request, so services always do it.

The engine times requests on the monotonic clock (immune to clock steps); spans travel in Unix seconds,
the only clock processes on different hosts share.
"""
from __future__ import annotations

import time

from epdserve.shared.engine import RequestMetrics
from epdserve.transport.channel.protocol import TraceSpan


def unix_time(monotonic: float) -> float:
    """A time.monotonic() reading as Unix seconds."""
    return monotonic + (time.time() - time.monotonic())


class RequestSpans:
    """Spans of one request in one service; `take()` hands them over once (the first delta carries them)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._spans: list[TraceSpan] = []
        # One monotonic -> Unix mapping for all of the request's spans: read anew for each, the two clocks'
        # difference wobbles by fractions of a microsecond, and spans that share an instant would not.
        self._offset = time.time() - time.monotonic()

    def add(self, name: str, start: float, end: float, num_bytes: int = 0, num_blocks: int = 0) -> None:
        """A stage from `start` to `end`, both time.monotonic() readings."""
        self._spans.append(TraceSpan(name, self.engine_id, start + self._offset, max(end, start) + self._offset,
                                     num_bytes, num_blocks))

    def add_engine_stages(self, metrics: RequestMetrics | None, queue: str = "prefill.queue",
                          compute: str = "prefill.compute") -> None:
        """The engine's own stages of a request it computed: arrival -> first scheduled (`queue`) -> first
        token (`compute`). Nothing for a stage the engine did not time."""
        if metrics is None or metrics.first_scheduled_time is None:
            return
        self.add(queue, metrics.arrival_time, metrics.first_scheduled_time)
        if metrics.first_token_time is not None:
            self.add(compute, metrics.first_scheduled_time, metrics.first_token_time)

    def take(self) -> tuple[TraceSpan, ...]:
        spans, self._spans = tuple(self._spans), []
        return spans

    def __len__(self) -> int:
        return len(self._spans)
