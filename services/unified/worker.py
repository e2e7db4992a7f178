"""The unified service: prefill and decode in one engine (single-node serving, and the baseline that
disaggregation is measured against). It takes GenerateRequests and streams tokens back; everything it
needs is in EngineWorker."""
from __future__ import annotations

from typing import Callable

from epdserve.services.host.engine_worker import EngineWorker, kv_transfer_client, start_engine
from epdserve.shared.config import EngineConfig, ServiceConfig
from epdserve.transport.channel.protocol import Role


async def build_unified_worker(service: ServiceConfig, engine_config: EngineConfig,
                               control_rejected: Callable[[], int],
                               on_dead: Callable[[BaseException], None]) -> UnifiedWorker:
    llm = await start_engine(service, engine_config, on_dead)
    return UnifiedWorker(service, engine_config, llm, kv_transfer_client(service, engine_config, llm), control_rejected)


class UnifiedWorker(EngineWorker):
    role = Role.UNIFIED
