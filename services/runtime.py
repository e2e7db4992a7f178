"""Builds a service from its config and runs it until SIGTERM/SIGINT.

Every service has a control channel (ZMQ ROUTER: typed requests from the proxy and peers), a management
HTTP port (/health, /ready, /metrics) and, for prefill and encoder, a data server that peers pull KV
blocks or embeddings from. Addresses handed to peers use the advertised host.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from epdserve.services.management import ManagementServer, build_management_app
from epdserve.services.network import advertised, client_curve, server_curve
from epdserve.shared.config import EngineConfig, ServiceConfig
from epdserve.shared.protocol import KVLayout, Role
from epdserve.transport.kv_transfer import create_client, create_server
from epdserve.transport.queues import ReplyServer, RequestClient
from epdserve.transport.security import WILDCARD_HOSTS

logger = logging.getLogger(__name__)

def kv_layout(engine: EngineConfig) -> KVLayout:
    m = engine.model
    return KVLayout(m.model_id, str(m.dtype).removeprefix("torch."), engine.cache.block_size, m.num_layers,
                    m.num_kv_heads, m.head_size)


async def run_service(service: ServiceConfig, engine: EngineConfig | None, model_path: str,
                      dtype: str = "float32", device: str = "cpu") -> None:
    """`engine` is None for an encoder, which loads `model_path`'s vision tower in `dtype` on `device`."""
    role = Role(service.role)
    transport = service.transport
    wildcard = service.host in WILDCARD_HOSTS
    control = ReplyServer(service.engine_id, host=service.host, port=service.port, allow_wildcard=wildcard,
                          curve=server_curve(transport))
    control_addr = advertised(await control.start(), service.host, service.advertise_host)
    push_kwargs = dict(engine_id=service.engine_id, role=role, curve=client_curve(transport),
                       timeout=transport.request_timeout)
    kv_server = None
    worker = None
    if role == Role.ENCODER:
        from epdserve.services.encoder.worker import EncoderWorker
        from epdserve.shared.config import parse_dtype

        worker = await asyncio.to_thread(EncoderWorker, service, model_path, parse_dtype(dtype), device)
        kv_server = create_server(transport.kv_backend, service.engine_id, encoder_cache=worker.cache,
                                  host=service.host, port=service.data_port, allow_wildcard=wildcard,
                                  curve=server_curve(transport))
    else:
        common = dict(push_kwargs=push_kwargs)
        if role == Role.PREFILL:
            from epdserve.services.prefill.worker import PrefillWorker

            # The KV server is built once the engine exists (it serves the engine's cache tensor).
            worker = await asyncio.to_thread(lambda: PrefillWorker(service, engine, kv_server=None,
                                                                   control_addr=control_addr, **common))
            kv_server = create_server(transport.kv_backend, service.engine_id, kv_cache=worker.kv_cache,
                                      layout=kv_layout(engine), host=service.host, port=service.data_port,
                                      allow_wildcard=wildcard, curve=server_curve(transport))
            worker.kv_server = kv_server
        elif role == Role.DECODE:
            from epdserve.services.decode.worker import DecodeWorker

            def make_client(address: str) -> RequestClient:
                return RequestClient(address, **push_kwargs)

            worker = await asyncio.to_thread(lambda: DecodeWorker(service, engine, make_client=make_client, **common))
        else:
            from epdserve.services.unified.worker import UnifiedWorker

            worker = await asyncio.to_thread(lambda: UnifiedWorker(service, engine, **common))
        # Pulls KV into (and image embeddings for) this engine's cache.
        worker.kv_client = create_client(transport.kv_backend, service.engine_id, role=role,
                                         kv_cache=worker.kv_cache, layout=kv_layout(engine),
                                         timeout=transport.transfer_timeout, curve=client_curve(transport))
    if kv_server is not None:
        worker.data_addr = advertised(await kv_server.start(), service.host, service.advertise_host)
    if hasattr(worker, "start"):
        await worker.start()
    worker.metrics.rejected_frames = lambda: control.num_rejected + (kv_server.num_rejected if kv_server else 0)

    def ready() -> tuple[bool, dict]:
        return True, {"role": role.value, "engine_id": service.engine_id}

    management = ManagementServer(build_management_app(ready, worker.metrics.registry), service.host,
                                  service.http_port)
    http_port = await management.start()
    serving = asyncio.create_task(control.serve(worker.handle))
    logger.info("%s %s ready: control %s, data %s, http port %d", role.value, service.engine_id, control_addr,
                worker.data_addr or "-", http_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    done, _ = await asyncio.wait({serving, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if serving in done:
        serving.result()  # the control loop died: raise, exit non-zero, let the supervisor restart us
    logger.info("%s %s stopping", role.value, service.engine_id)
    serving.cancel()
    await management.close()
    await worker.close()
    if kv_server is not None and role == Role.ENCODER:
        await kv_server.close()
    await control.close()
