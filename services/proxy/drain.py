"""The proxy's graceful shutdown: SIGTERM (or Ctrl-C) drains it, a second signal or the grace's end cuts.

    serving   -> draining  on the first signal: /ready answers 503 (load balancers stop sending), a new API
                           request gets a 503 OpenAI error with `Connection: close`; requests in flight go on
    draining  -> cut       after `timeout` seconds, or at once on a second signal: every request still in
                           flight ends - a stream with an error event and `data: [DONE]`, a request not yet
                           answered with a 503 error body - and is aborted on the services that hold it
    -> exit                once nothing is in flight (a cut request needs a moment to write its last event)

/health, /ready and /metrics stay open throughout: probes and scrapers see the drain as it happens.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from epdserve.services.proxy.app import MANAGEMENT_PATHS, error_response
from epdserve.services.proxy.generation import GenerationError

logger = logging.getLogger(__name__)

# After the cut: how long cut requests get to write their last event before the server stops anyway.
CUT_GRACE_SECONDS = 5.0


class Drain:
    """Whether the proxy is draining, what is still in flight, and the cut at the end of the grace."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # seconds requests in flight get to finish after the first signal
        self.draining = False
        self.num_inflight = 0  # API requests whose response has not ended
        self._cut: GenerationError | None = None
        self._on_cut: list[Callable[[GenerationError], None]] = []
        self._changed = asyncio.Event()  # a request ended, or the cut came

    @property
    def is_cut(self) -> bool:
        return self._cut is not None

    def on_cut(self, callback: Callable[[GenerationError], None]) -> None:
        """`callback(error)` runs once at the cut (the backend ends the streams it relays with it)."""
        self._on_cut.append(callback)

    def enter(self) -> None:
        self.num_inflight += 1

    def leave(self) -> None:
        self.num_inflight -= 1
        self._changed.set()

    def start(self) -> None:
        if not self.draining:
            self.draining = True
            logger.info("draining: %d request(s) in flight get up to %.0fs to finish; new ones are refused",
                        self.num_inflight, self.timeout)

    def cut(self) -> None:
        """End every request still in flight now."""
        if self._cut is not None:
            return
        self._cut = GenerationError(f"the server is shutting down: the request was cut after the {self.timeout:g}s "
                                    "drain grace", 503, "ServiceUnavailableError")
        if self.num_inflight:
            logger.warning("drain grace over: cutting %d request(s) still in flight", self.num_inflight)
        for callback in self._on_cut:
            callback(self._cut)
        self._changed.set()

    async def run(self) -> None:
        """Drain: wait until nothing is in flight, cutting what is left after `timeout` seconds."""
        self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while self.num_inflight and not self.is_cut and loop.time() < deadline:
            await self._wait_change(deadline - loop.time())
        self.cut()
        deadline = loop.time() + CUT_GRACE_SECONDS
        while self.num_inflight and loop.time() < deadline:
            await self._wait_change(deadline - loop.time())

    async def _wait_change(self, timeout: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), max(timeout, 0.0))
        except TimeoutError:
            pass


class DrainGate:
    """ASGI middleware: counts API requests in flight and, once the proxy drains, refuses new ones (503)."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.drain = app, drain
        self.on_refused = on_refused  # (status): counts the refusal among the HTTP responses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in MANAGEMENT_PATHS:
            return await self.app(scope, receive, send)
        if self.drain.draining:
            # Connection: close - a client on a kept-alive connection reconnects, through a load balancer
            # that has seen /ready fail, to another replica.
            response = error_response("the server is shutting down and takes no new requests; retry on another "
                                      "instance", "ServiceUnavailableError", 503, headers={"Connection": "close"})
            self.on_refused(503)
            return await response(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
