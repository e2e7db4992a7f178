"""Which worker `epdserve serve ROLE` hosts: the one place that knows every role's builder.

Each builder is imported when its role is served, so a service loads only what it runs (an encoder no
engine, a KV store no model)."""
from __future__ import annotations

from epdserve.services.runtime.service import WorkerBuilder, WorkerContext
from epdserve.shared.config import EngineConfig, ServiceConfig, parse_dtype


def worker_builder(config: ServiceConfig, engine: EngineConfig | None, model_path: str, dtype: str = "float32",
                   device: str = "cpu") -> WorkerBuilder:
    """`config.role`'s worker builder. `engine` is None for an encoder, which loads `model_path`'s vision tower
    in `dtype` on `device`, and for a KV store, which loads nothing."""
    role = config.role

    async def build(context: WorkerContext):
        if role == "kvstore":
            from epdserve.services.kvstore.worker import build_kvstore_worker

            return await build_kvstore_worker(config, context.control_rejected)
        if role == "encoder":
            from epdserve.services.encoder.worker import build_encoder_worker

            return await build_encoder_worker(config, model_path, parse_dtype(dtype), device,
                                              context.control_rejected)
        if role == "prefill":
            from epdserve.services.prefill.worker import build_prefill_worker

            return await build_prefill_worker(config, engine, context.control_addr, context.control_rejected,
                                              context.on_engine_dead)
        if role == "decode":
            from epdserve.services.decode.worker import build_decode_worker

            return await build_decode_worker(config, engine, context.control_rejected, context.on_engine_dead)
        if role == "unified":
            from epdserve.services.unified.worker import build_unified_worker

            return await build_unified_worker(config, engine, context.control_rejected, context.on_engine_dead)
        raise ValueError(f"no worker serves the role {role!r}")

    return build
