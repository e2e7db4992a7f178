"""The block connections as a KV transfer data path (stream.py has their protocol): BlockStreamServerPath opens
a port beside a KV transfer server's control channel and announces it in the handshake, with a token that ties
a connection to a peer the channel accepted; BlockStreamClientPath fetches over it into a CPU cache. The "zmq"
transport's path for blocks wherever its channel is not encrypted and the cache is on the CPU.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from epdserve.transport.block_stream.stream import BlockStreamClient, BlockStreamServer
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.protocol import MAY_SEND, Error, ErrorCode, FetchBlocks, Handshake, HandshakeAck
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.kv.base import Chunk, ClientPath, ServerPath
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.kv.server import KVTransferServer


class BlockStreamServerPath(ServerPath):
    """A KV transfer server's block connections: a port beside its control channel, announced in the
    handshake (with a token that ties a connection to a peer the channel accepted) to peers that may fetch
    blocks of its layout."""

    transport = "zmq"

    def __init__(self, host: str, port: int = 0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.host, self.port, self.limits = host, port, limits
        self.stream: BlockStreamServer | None = None

    def bind(self, server: KVTransferServer) -> None:
        super().bind(server)
        self.stream = BlockStreamServer(server.engine_id, self.host, self._prepare, port=self.port, limits=self.limits,
                                        lock=server.lock)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.stream.start()

    def ack_extra(self, hello: Handshake) -> dict:
        if hello.kv_layout != self.server.layout or FetchBlocks not in MAY_SEND.get(hello.role, ()):
            return {}
        return {"data_port": self.stream.port, "data_token": self.stream.token}

    def _prepare(self, message: FetchBlocks) -> Sequence[np.ndarray] | Error:
        """A connection's request (on its thread, under the server's lock): its segments' bytes, or why not."""
        if message.ucx_tag is not None:
            return Error(ErrorCode.BAD_REQUEST, "a UCX fetch on a block connection", message.request_id)
        started = time.perf_counter()
        try:
            buffers = self.server.segment_bytes(message)
        except ErrorReply as e:
            return e.error
        # Counted on the event loop, which owns the stats (control-channel fetches count there too).
        self._loop.call_soon_threadsafe(self.server.stats.record, sum(b.nbytes for b in buffers), started)
        return buffers

    def sending(self, request_id: str) -> bool:
        return self.stream.sending(request_id)

    def abort(self, request_id: str) -> None:
        self.stream.abort(request_id)

    @property
    def num_rejected(self) -> int:
        return self.stream.num_rejected

    async def close(self) -> None:
        await self.stream.close()


class BlockStreamClientPath(ClientPath):
    """A KV transfer client's block connections, to servers that announced a port, into a CPU cache."""

    transport = "zmq"

    def bind(self, client: KVTransferClient) -> None:
        super().bind(client)
        self.stream = BlockStreamClient(client.engine_id, limits=client.limits, idle_seconds=client.peer_idle_seconds)

    def usable(self, peer: HandshakeAck) -> bool:
        return peer.data_port is not None and self.client.kv_cache.device.type == "cpu"

    async def fetch_chunk(self, control: RequestClient, request: FetchBlocks, chunk: Chunk, deadline: float) -> int:
        client, peer = self.client, control.peer
        buffers, gathered = client.landing(chunk)
        host = control.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        sent, landed = await self.stream.fetch(host, peer.data_port, peer.data_token or b"", request, buffers,
                                               client.remaining(deadline))
        return client.land(chunk, buffers, sent, landed=landed, gathered=gathered,
                           source=f"{host}:{peer.data_port}")

    async def close(self) -> None:
        await self.stream.close()
