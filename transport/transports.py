"""The KV transports (`--kv-transport`) as the data paths each is made of: "zmq" (the default) moves blocks
over plain TCP block connections (block_stream/) where it can - a CPU cache, a channel CURVE does not
encrypt - and as ZMQ frames (zmq_frames/) otherwise, embeddings as frames; "ucx" moves both as UCX tagged
messages (ucx/, the `ucx` extra). The one module above the data paths: it assembles them into a KV transfer
server or client (kv/)."""
from __future__ import annotations

from typing import Mapping

from epdserve.transport.block_stream.path import BlockStreamClientPath, BlockStreamServerPath
from epdserve.transport.channel.limits import DEFAULT_LIMITS
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.zmq_frames.path import FrameClientPath, FrameServerPath

TRANSPORTS = ("zmq", "ucx")


def create_server(transport: str, engine_id: str, *, block_port: int | None = 0, net_devices: str | None = None,
                  ucx_options: Mapping[str, str] | None = None, **kwargs) -> KVTransferServer:
    """A KV transfer server of `transport` (KVTransferServer's keyword arguments in `kwargs`). "zmq":
    `block_port` is the block connections' port (0: any free one; None: none, blocks go as frames);
    "ucx": `net_devices` and `ucx_options` as UcxServerPath's."""
    if transport == "zmq":
        kv_cache = kwargs.get("kv_cache")
        streams = block_port is not None and kwargs.get("curve") is None and kv_cache is not None \
            and kv_cache.device.type == "cpu"
        paths = [FrameServerPath()]
        if streams:
            paths.append(BlockStreamServerPath(kwargs.get("host", "127.0.0.1"), block_port,
                                               kwargs.get("limits", DEFAULT_LIMITS)))
        return KVTransferServer(engine_id, paths, **kwargs)
    if transport == "ucx":
        from epdserve.transport.ucx.path import UcxServerPath

        return KVTransferServer(engine_id, [UcxServerPath(net_devices, ucx_options)], **kwargs)
    raise ValueError(f"unknown KV transport {transport!r}; choose from {TRANSPORTS}")


def create_client(transport: str, engine_id: str, *, net_devices: str | None = None,
                  ucx_options: Mapping[str, str] | None = None, **kwargs) -> KVTransferClient:
    """A KV transfer client of `transport` (KVTransferClient's keyword arguments in `kwargs`)."""
    if transport == "zmq":
        return KVTransferClient(engine_id, [BlockStreamClientPath(), FrameClientPath()], **kwargs)
    if transport == "ucx":
        from epdserve.transport.ucx.path import UcxClientPath

        return KVTransferClient(engine_id, [UcxClientPath(net_devices, ucx_options)], **kwargs)
    raise ValueError(f"unknown KV transport {transport!r}; choose from {TRANSPORTS}")
