"""Every service's management port: /health (alive), /ready (serving), /metrics.

/health answers 503 once the service is UNHEALTHY (its engine loop died: it is about to exit for its
supervisor to restart it); /ready answers 200 only while it is READY (not STARTING, DRAINING or UNHEALTHY).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from epdserve.transport.channel.protocol import Health

logger = logging.getLogger(__name__)


def build_management_app(health: Callable[[], tuple[Health, dict]],
                         registry: Callable[[], CollectorRegistry | None]) -> FastAPI:
    """`health()` -> (health, details for /ready); `registry()` -> the metrics (None while starting)."""
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/health")
    async def alive() -> Response:
        return Response(status_code=503 if health()[0] == Health.UNHEALTHY else 200)

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        state, details = health()
        ok = state == Health.READY
        return JSONResponse({"ready": ok, "status": state.value, **details}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        metrics_registry = registry()
        body = generate_latest(metrics_registry) if metrics_registry is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


class SignalFreeServer(uvicorn.Server):
    """uvicorn that leaves SIGTERM and SIGINT to its service. uvicorn's own handlers would stop the server alone,
    leave the service running without its port, and put back the handlers it found (SIG_IGN for a script's
    background job) when it stops; a service installs its handlers before it starts one of these."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class ManagementServer:
    """uvicorn on the service's own event loop (no second thread, no second process)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.server = SignalFreeServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                      access_log=False, lifespan="off"))
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # bind failure: raise it
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.server.should_exit = True
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
