"""The unified service: prefill and decode in one engine (single-node serving, and the baseline that
disaggregation is measured against). It takes GenerateRequests and streams tokens back; everything it
needs is in EngineWorker."""
from epdserve.services.engine_worker import EngineWorker
from epdserve.shared.protocol import Role


class UnifiedWorker(EngineWorker):
    role = Role.UNIFIED
