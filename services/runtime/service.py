"""Builds a service from its config and runs it until SIGTERM/SIGINT, or until its engine dies.

Every service has a control channel (ZMQ ROUTER: typed requests from the proxy and peers), a management
HTTP port (/health, /ready, /metrics) and, for prefill and encoder, a data server that peers pull KV
blocks or embeddings from. Addresses handed to peers use the advertised host.

Health, as the control channel's Status and the management port report it:
    STARTING   from the first moment, while the model loads (status answers; requests are refused)
    READY      serving
    DRAINING   after SIGTERM (or SIGINT): takes nothing new, finishes what it holds (up to `drain_timeout`,
               or until a second signal), then stops the streams still running - each proxy hears why
               and ends its client's stream with an error event - and exits 0
    UNHEALTHY  the engine loop died: every waiter has been failed; the process exits 1 for its
               supervisor to restart it
"""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from prometheus_client import Gauge

from epdserve.services.runtime.management import ManagementServer, build_management_app
from epdserve.services.runtime.network import advertised, peer_auth, say_if_unauthenticated, server_curve
from epdserve.shared.config import ServiceConfig
from epdserve.transport.channel.protocol import (MAY_SEND, DecodeRequest, EncodeRequest, Error, ErrorCode,
                                                 GenerateRequest, Handshake, Health, Message, PrefillRequest, Role,
                                                 Status, StatusRequest)
from epdserve.transport.channel.reply_server import ReplyServer
from epdserve.transport.channel.security import WILDCARD_HOSTS

logger = logging.getLogger(__name__)

# What only a READY service takes; everything else (status, aborts, releases) concerns what it holds.
NEW_WORK = (EncodeRequest, PrefillRequest, DecodeRequest, GenerateRequest)
# How long an unhealthy service keeps answering before it exits: its waiters hear why, its pollers see it.
UNHEALTHY_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class WorkerContext:
    """What a role's worker needs of the service that hosts it."""
    control_addr: str  # the service's control channel, as peers reach it
    control_rejected: Callable[[], int]  # frames the control channel dropped
    on_engine_dead: Callable[[BaseException], None]  # called on the engine's thread when its loop dies


# A role's worker, whole: its engine (or encoder) loaded and its data server serving. The command line picks
# it by role (services/cli/roles.py), so that this runtime knows no role.
WorkerBuilder = Callable[[WorkerContext], Awaitable[Any]]


class Service:
    """One service process: its health, its channels, and its worker once built."""

    def __init__(self, config: ServiceConfig, build_worker: WorkerBuilder) -> None:
        self.config = config
        self.build_worker = build_worker
        self.role = Role(config.role)
        self.health = Health.STARTING
        self.worker = None
        self.exit_code = 0
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()  # a second signal: the drain ends at once
        self.control_addr = ""
        self.http_port = 0

    async def run(self) -> int:
        """Serve until stopped; the exit code (1 if the engine died)."""
        config, role = self.config, self.role
        transport = config.transport
        say_if_unauthenticated(transport, config.host)
        control = ReplyServer(config.engine_id, host=config.host, port=config.port,
                              allow_wildcard=config.host in WILDCARD_HOSTS, curve=server_curve(transport),
                              auth=peer_auth(transport), senders=MAY_SEND)
        self.control_addr = advertised(await control.start(), config.host, config.advertise_host)
        # Before its port answers: a signal from then on stops the service, whatever its parent ignored.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        management = ManagementServer(
            build_management_app(self._management_state,
                                 lambda: self.worker.metrics.registry if self.worker is not None else None),
            config.host, config.http_port)
        self.http_port = await management.start()
        serving = asyncio.create_task(control.serve(self.handle))  # answers STARTING until the worker is built

        worker = self.worker = await self._build_worker(lambda: control.num_rejected)
        count_refused_peers(worker, control, role.value, config.engine_id)
        if self.health == Health.STARTING:
            self.health = Health.READY
        logger.info("%s %s ready: control %s, data %s, http port %d, KV transport %s", role.value, config.engine_id,
                    self.control_addr, worker.data_addr or "-", self.http_port, config.transport.kv_transport)

        stopping = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            serving.result()  # the control loop died: raise, exit non-zero, let the supervisor restart us
        await self._drain()
        logger.info("%s %s stopping", role.value, config.engine_id)
        serving.cancel()
        await management.close()
        await worker.close()
        await control.close()
        return self.exit_code

    async def _build_worker(self, control_rejected: Callable[[], int]):
        loop = asyncio.get_running_loop()

        def on_dead(cause: BaseException) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(self._engine_died, cause)

        return await self.build_worker(WorkerContext(self.control_addr, control_rejected, on_dead))

    def status(self) -> Status:
        if self.worker is None:
            return Status(self.config.engine_id, self.role, self.health, 0, 0, 0, 0)
        return self.worker.status(self.health)

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, StatusRequest):
            return self.status()
        if self.worker is None or (isinstance(message, NEW_WORK) and self.health != Health.READY):
            # Retryable: another instance may take it.
            return Error(ErrorCode.OVERLOADED, f"{self.role.value} {self.config.engine_id} is {self.health.value}",
                         getattr(message, "request_id", None), True)
        return await self.worker.handle(message, peer)

    def _on_signal(self) -> None:
        if self.stop.is_set():
            self.hurry.set()
        self.stop.set()

    def _management_state(self) -> tuple[Health, dict]:
        return self.health, {"role": self.role.value, "engine_id": self.config.engine_id}

    def _engine_died(self, cause: BaseException) -> None:
        logger.error("%s %s: the engine loop died (%r); exiting", self.role.value, self.config.engine_id, cause)
        self.health = Health.UNHEALTHY
        self.exit_code = 1
        asyncio.get_running_loop().call_later(UNHEALTHY_GRACE_SECONDS, self.stop.set)

    async def _drain(self) -> None:
        """Finish what is in flight (nothing new is taken), at most `drain_timeout` seconds."""
        if self.health != Health.READY or self.worker is None:
            return
        self.health = Health.DRAINING
        if self.worker.busy:
            logger.info("%s %s draining: finishing the requests in flight, up to %gs (a second signal ends it)",
                        self.role.value, self.config.engine_id, self.config.drain_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while self.worker.busy and loop.time() < deadline and not self.hurry.is_set():
            await asyncio.sleep(0.1)
        if self.worker.busy:
            drained = self.config.drain_timeout - max(deadline - loop.time(), 0.0)
            logger.warning("%s %s: stopping with requests still in flight after %.1fs of draining",
                           self.role.value, self.config.engine_id, drained)
            stop_streams = getattr(self.worker, "stop_streams", None)  # encoders hold no streams
            if stop_streams is not None:
                stop_streams(f"{self.role.value} {self.config.engine_id} shut down before the request finished "
                             f"(after {drained:.1f}s of draining)")


async def run_service(config: ServiceConfig, build_worker: WorkerBuilder) -> int:
    """Run one service until stopped; its exit code."""
    return await Service(config, build_worker).run()


def count_refused_peers(worker, control: ReplyServer, role: str, engine_id: str) -> None:
    """Export how many peers this service refused for want of the deployment's credentials (no proof of its
    secret, a CURVE key not allowed), on its control channel and its KV transfer server."""
    labels = {"role": role, "engine_id": engine_id}
    kv_server = getattr(worker, "kv_server", None)
    gauge = Gauge("epdserve:peer_auth_refused", "Peers refused: no proof of the deployment's secret, or a CURVE key "
                  "not allowed.", list(labels), registry=worker.metrics.registry).labels(**labels)
    gauge.set_function(lambda: control.num_auth_denied + (kv_server.num_auth_denied if kv_server is not None else 0))
