"""The default KVTransfer backend: typed ZMQ messages, and blocks over plain TCP connections.

Handshakes, fetch requests, embeddings and errors go over the typed ZMQ channel. Blocks go over a
plain TCP connection (block_stream): the server writes each segment (run x layer x K/V) from its
cache, the client receives it straight into its destination blocks - no gather, no staging copy.
With CURVE, whose encryption covers the ZMQ channel only, or with a device cache on either side,
blocks travel as zero-copy ZMQ frames instead: sent from the cache's memory (the server keeps the
frames' trackers so that the blocks are not freed while ZMQ's IO thread still reads them,
`wait_sent`), received into memory libzmq allocates and copied once into the cache - ZMQ has no
receive into caller memory, and hands a multipart message over only whole.

A fetch is split into messages (see ZmqKVClient._messages), up to `max_inflight_messages` of them in
flight. Copies out of ZMQ frames run on the event loop thread: handing them to a worker thread cost
more in wake-ups than it saved (measured on two cores: up to 1.5x slower).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import typing
from dataclasses import dataclass
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import torch
import zmq

from epdserve.transport.protocol import (
    BlocksData, EmbeddingsData, Error, ErrorCode, FetchBlocks, FetchEmbeddings, Handshake, HandshakeAck,
    KVLayout, MAY_SEND, Message, Role,
)
from epdserve.transport import codec
from epdserve.transport.block_stream import BlockStreamClient, BlockStreamServer
from epdserve.transport.codec import DEFAULT_LIMITS, Limits
from epdserve.transport.kv_transfer import (
    BlockRangeError, BlocksNotFoundError, EmbeddingNotFoundError, EmbeddingSource, FetchResult,
    IncompatiblePeerError, KVTransferClient, KVTransferServer, Run, TransferError, TransferTimeout,
    as_bytes, copy_segment, gather_blocks, layout_mismatch, run_segments, run_views, scatter_blocks, split_runs,
)
from epdserve.transport.channel import ChannelError, ChannelTimeout, ErrorReply, HandshakeError
from epdserve.transport import peer_pool
from epdserve.transport.peer_pool import PeerPool
from epdserve.transport.reply_server import ReplyServer
from epdserve.transport.request_client import RequestClient
from epdserve.transport.security import CurveConfig

logger = logging.getLogger(__name__)

_ERROR_CODES = {
    BlockRangeError: ErrorCode.OUT_OF_RANGE,
    BlocksNotFoundError: ErrorCode.NOT_FOUND,
    EmbeddingNotFoundError: ErrorCode.NOT_FOUND,
    IncompatiblePeerError: ErrorCode.INCOMPATIBLE,
}


def _error_reply(error: TransferError, request_id: str | None = None) -> ErrorReply:
    code = _ERROR_CODES.get(type(error), ErrorCode.INTERNAL)
    return ErrorReply(Error(code, str(error), request_id))


def transport_mismatch(ours: str, theirs: str | None, us: str, them: str) -> str | None:
    """Why two ends cannot move data between them, or None: each must use the same transport."""
    if theirs is None or theirs == ours:
        return None
    return (f"{us} moves KV and embeddings over {ours}, {them} over {theirs}: start every encoder, "
            f"prefill and decode of a deployment with the same --kv-transport")


class ZmqKVServer(KVTransferServer):
    """KV transfer server on a ROUTER socket, with a port for block connections beside it
    (`block_stream`; `block_port` 0: any free port, None: none - nor with CURVE or a device cache, whose
    blocks go as ZMQ frames); see KVTransferServer."""

    TRANSPORT = "zmq"

    def __init__(
        self,
        engine_id: str,
        *,
        kv_cache: torch.Tensor | None = None,
        model_id: str = "",
        encoder_cache: EmbeddingSource | None = None,
        layout: KVLayout | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_wildcard: bool = False,
        curve: CurveConfig | None = None,
        limits: Limits = DEFAULT_LIMITS,
        max_inflight: int = 8,
        block_port: int | None = 0,
    ):
        super().__init__(engine_id, kv_cache=kv_cache, model_id=model_id, encoder_cache=encoder_cache, layout=layout)
        self._server = ReplyServer(
            engine_id, host=host, port=port, allow_wildcard=allow_wildcard, curve=curve, limits=limits,
            kv_layout=self.layout, kv_transport=self.TRANSPORT, on_sent=self._on_sent,
            check_handshake=self._check_peer, max_inflight=max_inflight, senders=MAY_SEND,
            ack_extra=self._ack_extra,
        )
        self._stream = (BlockStreamServer(engine_id, host, self._prepare_stream, port=block_port, limits=limits)
                        if block_port is not None and curve is None and kv_cache is not None
                        and kv_cache.device.type == "cpu" else None)
        self._serve_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> trackers of replies whose frames ZMQ may still be reading from the cache.
        self._unsent: dict[str, list[zmq.MessageTracker]] = {}

    @property
    def address(self) -> str:
        return self._server.address

    @property
    def num_rejected(self) -> int:
        """Frames dropped by the control channel (malformed, oversized, other version) and block
        connections dropped (a wrong token, a malformed request)."""
        return self._server.num_rejected + self.num_stream_rejected

    @property
    def num_auth_denied(self) -> int:
        return self._server.num_auth_denied

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        if self._stream is not None:
            await self._stream.start()  # before the first handshake, whose answer names its port
        address = await self._server.start()
        if self._serve_task is None:
            self._serve_task = asyncio.create_task(self._server.serve(self._handle))
        return address

    async def close(self) -> None:
        if self._serve_task is not None:
            self._serve_task.cancel()
            self._serve_task = None
        await self._server.close()
        if self._stream is not None:
            await self._stream.close()

    def withdraw(self, request_id: str) -> None:
        if self._stream is None:
            return super().withdraw(request_id)
        with self._stream.lock:  # a block connection checks a request and starts its send under it
            super().withdraw(request_id)

    @property
    def num_stream_rejected(self) -> int:
        """Block connections dropped for a wrong token or a malformed request."""
        return self._stream.num_rejected if self._stream is not None else 0

    def _ack_extra(self, hello: Handshake) -> dict:
        """The block port and its token, for peers that may fetch blocks of our layout."""
        if (self._stream is None or hello.kv_layout != self.layout
                or FetchBlocks not in MAY_SEND.get(hello.role, ())):
            return {}
        return {"data_port": self._stream.port, "data_token": self._stream.token}

    async def _check_peer(self, hello: Handshake) -> str | None:
        refusal = transport_mismatch(self.TRANSPORT, hello.kv_transport, self.engine_id, hello.engine_id)
        if refusal is None and self.layout is not None and hello.kv_layout is not None:
            refusal = layout_mismatch(self.layout, hello.kv_layout, self.engine_id, hello.engine_id)
        return refusal

    def _on_sent(self, reply: Message, tracker: zmq.MessageTracker) -> None:
        if isinstance(reply, BlocksData) and not tracker.done:
            trackers = self._unsent.setdefault(reply.request_id, [])
            trackers[:] = [t for t in trackers if not t.done]
            trackers.append(tracker)

    async def wait_sent(self, request_id: str, timeout: float = 60.0) -> bool:
        trackers = self._unsent.pop(request_id, [])
        deadline = time.monotonic() + timeout
        while any(not t.done for t in trackers) or (self._stream is not None and self._stream.sending(request_id)):
            if time.monotonic() > deadline:
                if self._stream is not None:
                    self._stream.abort(request_id)  # the peer's fetch fails rather than read freed blocks
                return False
            await asyncio.sleep(0.001)
        return True

    async def _handle(self, message: Message, peer: Handshake) -> Message:
        if isinstance(message, FetchBlocks):
            return await self._serve_blocks(message, peer)
        if isinstance(message, FetchEmbeddings):
            try:
                tensor = self.embeddings(message.mm_hash)
            except TransferError as e:
                raise _error_reply(e) from None
            reply = await self._reply_embeddings(message, peer, tensor)
            self.stats.num_bytes += tensor.nbytes
            self.stats.num_transfers += 1
            return reply
        raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"{self.engine_id} serves block and embedding fetches only"))

    async def _serve_blocks(self, message: FetchBlocks, peer: Handshake) -> Message:
        if self.layout is None or peer.kv_layout != self.layout:
            raise ErrorReply(Error(ErrorCode.INCOMPATIBLE, "no KV layout agreed in the handshake", message.request_id))
        started = time.perf_counter()
        reply, num_bytes = await self._reply_blocks(message, peer)
        self.stats.record(num_bytes, started)
        return reply

    def _runs(self, message: FetchBlocks) -> list[Run] | None:
        """The runs FetchBlocks cuts its blocks into (None: gathered); ErrorReply when it asks for
        blocks not exposed for its request or cuts them into bad runs."""
        try:
            self.check_exposed(message.request_id, message.block_ids)
            return split_runs(message.block_ids, message.run_lengths) if message.run_lengths else None
        except TransferError as e:
            raise _error_reply(e, message.request_id) from None

    def _segments(self, message: FetchBlocks) -> list[torch.Tensor]:
        """The segments FetchBlocks describes, as views of the cache (gathered: a copy)."""
        runs = self._runs(message)
        return (run_segments(self.kv_cache, runs) if runs is not None
                else [gather_blocks(self.kv_cache, message.block_ids)] if message.block_ids else [])

    def _segment_bytes(self, message: FetchBlocks) -> list:
        """The segments FetchBlocks describes as flat bytes of the cache's memory, for a socket or UCX to
        send: numpy views of a CPU cache (cheaper than a tensor view each), device tensors of a GPU one."""
        runs = self._runs(message)
        if runs is None:
            return [as_bytes(gather_blocks(self.kv_cache, message.block_ids))] if message.block_ids else []
        if self.kv_cache.device.type == "cpu":
            return run_views(self.kv_cache, runs)
        return [as_bytes(segment) for segment in run_segments(self.kv_cache, runs)]

    def _prepare_stream(self, message: FetchBlocks) -> list[np.ndarray] | Error:
        """A block connection's request (on its thread): the segments' bytes to send, or why not."""
        if message.ucx_tag is not None:
            return Error(ErrorCode.BAD_REQUEST, "a UCX fetch on a block connection", message.request_id)
        started = time.perf_counter()
        try:
            buffers = self._segment_bytes(message)
        except ErrorReply as e:
            return e.error
        # Counted on the event loop, which owns the stats (ZMQ fetches count there too).
        self._loop.call_soon_threadsafe(self.stats.record, sum(b.nbytes for b in buffers), started)
        return buffers

    async def _reply_blocks(self, message: FetchBlocks, peer: Handshake) -> tuple[Message, int]:
        """The answer to a FetchBlocks that came over ZMQ, and the bytes it moves."""
        if message.ucx_tag is not None:
            raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"{self.engine_id} has no UCX data path", message.request_id))
        segments = self._segments(message)
        reply = BlocksData(message.request_id, message.block_ids, tuple(_host_segments(segments)))
        return reply, sum(segment.nbytes for segment in segments)

    async def _reply_embeddings(self, message: FetchEmbeddings, peer: Handshake, tensor: torch.Tensor) -> Message:
        if message.ucx_tag is not None:
            raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"{self.engine_id} has no UCX data path"))
        return EmbeddingsData(message.mm_hash, tensor.detach().cpu())  # a GPU encoder cache sends host bytes


def _host_segments(segments: list[torch.Tensor]) -> list[torch.Tensor]:
    """Segments in host memory, for a socket to send: device segments are copied into one pinned
    staging buffer (torch's pinned-memory cache hands the same memory back to the next message)."""
    if not segments or segments[0].device.type == "cpu":
        return segments
    staging = torch.empty(sum(s.numel() for s in segments), dtype=segments[0].dtype, pin_memory=True)
    views, offset = [], 0
    for segment in segments:
        view = staging[offset:offset + segment.numel()].view(segment.shape)
        view.copy_(segment, non_blocking=True)
        views.append(view)
        offset += segment.numel()
    torch.cuda.current_stream(segments[0].device).synchronize()
    return views


class ZmqKVClient(KVTransferClient):
    """KV transfer client with one DEALER connection per server address; see KVTransferClient."""

    TRANSPORT = "zmq"

    def __init__(
        self,
        engine_id: str,
        *,
        kv_cache: torch.Tensor | None = None,
        model_id: str = "",
        layout: KVLayout | None = None,
        role: Role = Role.DECODE,
        timeout: float = 30.0,
        curve: CurveConfig | None = None,
        limits: Limits = DEFAULT_LIMITS,
        max_message_bytes: int = 256 << 20,
        min_message_bytes: int = 64 << 20,
        max_inflight_messages: int = 2,
        min_segment_bytes: int = 64 << 10,
        peer_idle_seconds: float = peer_pool.IDLE_SECONDS,
    ):
        super().__init__(engine_id, kv_cache=kv_cache, model_id=model_id, layout=layout)
        self.role = role
        self.timeout = timeout
        self.limits = limits
        # Large messages: runs cost no gather, so a message costs a round trip and Python work per
        # segment, and few large ones measured fastest (64-256 MiB x 2 in flight on 2 cores; ZMQ
        # receives each segment into its own frame, far below a message's size).
        self.max_message_bytes = max_message_bytes
        self.min_message_bytes = min_message_bytes
        self.max_inflight_messages = max_inflight_messages
        # A run whose segments are smaller than this travels gathered: pyzmq copies frames under
        # 64 KiB anyway, and per-segment costs outweigh one gather and one scatter.
        self.min_segment_bytes = min_segment_bytes
        self._curve = curve
        # address -> connection, reused across fetches, closed once unused for `peer_idle_seconds` (servers
        # come and go)
        self.peer_idle_seconds = peer_idle_seconds
        self._clients: PeerPool[str, RequestClient] = PeerPool(self._open_client, RequestClient.close,
                                                               idle_seconds=peer_idle_seconds)
        # block connections (threads on first use)
        self._stream = BlockStreamClient(engine_id, limits=limits, idle_seconds=peer_idle_seconds)

    def _ucx_address(self) -> bytes | None:
        return None

    def _check_ack(self, ack: HandshakeAck) -> str | None:
        refusal = transport_mismatch(self.TRANSPORT, ack.kv_transport, self.engine_id, ack.engine_id)
        if refusal is None and self.layout is not None and ack.kv_layout is not None:
            refusal = layout_mismatch(self.layout, ack.kv_layout, self.engine_id, ack.engine_id)
        return refusal

    def _open_client(self, address: str) -> RequestClient:
        return RequestClient(address, engine_id=self.engine_id, role=self.role, timeout=self.timeout,
                             curve=self._curve, limits=self.limits, kv_layout=self.layout,
                             kv_transport=self.TRANSPORT, ucx_address=self._ucx_address(), check_ack=self._check_ack)

    def _remaining(self, deadline: float) -> float:
        return max(deadline - asyncio.get_running_loop().time(), 0.0)

    async def fetch_blocks(
        self,
        kv_addr: str,
        request_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> FetchResult:
        pairs = self.runs(remote_block_ids, local_block_ids)
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)
        chunks = self._messages(pairs)
        connect_seconds = 0.0
        try:
            with self._clients.holding(kv_addr) as client:
                if client.peer is None:
                    await client.connect(self._remaining(deadline))
                    connect_seconds = time.perf_counter() - started
                if client.peer.kv_layout != self.layout:
                    raise IncompatiblePeerError(f"{kv_addr} ({client.peer.engine_id}) has no matching KV cache")
                num_bytes = sum(await self._bounded(
                    [functools.partial(self._fetch_chunk, client, request_id, chunk, deadline) for chunk in chunks]
                ))
        except BaseException as e:
            self._fail(e, kv_addr)
        return self.stats.record(num_bytes, started, connect_seconds)

    def _messages(self, pairs: list[tuple[Run, Run]]) -> list[Chunk]:
        """The fetch's messages: runs whose segments reach `min_segment_bytes` in messages of their own,
        shorter ones gathered; at most max_message_bytes each, and small enough that a fetch spans a few
        messages (the last one's copy into the cache overlaps nothing, so it must be short)."""
        block_bytes, segment_bytes = self.kv_cache[:, :, 0].nbytes, self.kv_cache[0, 0, 0].nbytes
        long, short = [], []
        for pair in pairs:
            (long if pair[0].length * segment_bytes >= self.min_segment_bytes else short).append(pair)
        chunks = []
        for group, gathered, largest in ((long, False, self.max_message_bytes),
                                         (short, True, min(self.max_message_bytes, GATHERED_MESSAGE_BYTES))):
            num_blocks = sum(remote.length for remote, _ in group)
            target = min(largest, max(self.min_message_bytes, num_blocks * block_bytes // 4))
            chunks += [Chunk(part, gathered) for part in _split(group, max(1, target // block_bytes))]
        return chunks

    async def _bounded(self, jobs: list[Callable[[], Awaitable[int]]]) -> list[int]:
        """Run jobs at most `max_inflight_messages` at a time; the first failure cancels the rest."""
        if len(jobs) == 1:
            return [await jobs[0]()]  # most fetches: no tasks to schedule
        gate = asyncio.Semaphore(self.max_inflight_messages)

        async def gated(job):
            async with gate:
                return await job()

        tasks = [asyncio.ensure_future(gated(job)) for job in jobs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    def _landing(self, chunk: Chunk) -> tuple[list, torch.Tensor | None]:
        """Flat bytes a message's segments are received into (as `_segment_bytes`): the destination
        blocks themselves, or for gathered blocks one new tensor - returned too, to scatter from."""
        if chunk.gathered:
            gathered = torch.empty(self._gathered_shape(chunk), dtype=self.kv_cache.dtype, device=self.kv_cache.device)
            return [as_bytes(gathered)], gathered
        if self.kv_cache.device.type == "cpu":
            return run_views(self.kv_cache, chunk.local_runs), None
        return [as_bytes(segment) for segment in run_segments(self.kv_cache, chunk.local_runs)], None

    async def _fetch_chunk(self, client: RequestClient, request_id: str, chunk: Chunk, deadline: float) -> int:
        # Handshaken again if the connection dropped since the fetch began (a restarted server has a new port).
        peer = client.peer or await client.connect(self._remaining(deadline))
        if peer.data_port is None or self.kv_cache.device.type != "cpu":
            return await self._fetch_frames(client, request_id, chunk, deadline)
        buffers, gathered = self._landing(chunk)
        num_bytes = await self._stream.fetch(_host(client.address), peer.data_port, peer.data_token or b"",
                                             chunk.request(request_id), buffers, self._remaining(deadline))
        if gathered is not None:
            scatter_blocks(self.kv_cache, chunk.local_ids, gathered)
        return num_bytes

    async def _fetch_frames(self, client: RequestClient, request_id: str, chunk: Chunk, deadline: float) -> int:
        request = chunk.request(request_id)
        reply = await client.request(request, timeout=self._remaining(deadline), expect=BlocksData)
        if reply.block_ids != request.block_ids:
            raise TransferError(f"{client.address} answered with blocks {reply.block_ids[:8]}..., not those asked for")
        destinations = None if chunk.gathered else run_segments(self.kv_cache, chunk.local_runs)
        shapes = [self._gathered_shape(chunk)] if chunk.gathered else [d.shape for d in destinations]
        if len(reply.segments) != len(shapes):
            raise BlockRangeError(f"peer sent {len(reply.segments)} segments, expected {len(shapes)}")
        for segment, shape in zip(reply.segments, shapes):
            if segment.dtype != self.kv_cache.dtype or segment.shape != shape:
                raise BlockRangeError(f"peer sent {segment.dtype}{list(segment.shape)}, expected "
                                      f"{self.kv_cache.dtype}{list(shape)}")
        if chunk.gathered:
            scatter_blocks(self.kv_cache, chunk.local_ids, reply.segments[0])
        else:
            for segment, destination in zip(reply.segments, destinations):
                copy_segment(destination, segment)
        return sum(segment.nbytes for segment in reply.segments)

    def _gathered_shape(self, chunk: Chunk) -> torch.Size:
        """The one segment a gathered message's blocks travel in: [layers, 2, n, *block], as our cache's."""
        return torch.Size((self.kv_cache.shape[0], 2, sum(local.length for local in chunk.local_runs),
                           *self.kv_cache.shape[3:]))

    async def fetch_embeddings(self, encoder_addr: str, mm_hash: str, *, timeout: float | None = None) -> torch.Tensor:
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)
        try:
            with self._clients.holding(encoder_addr) as client:
                tensor = await self._fetch_embeddings(client, mm_hash, deadline)
            if tensor.dim() != 2:
                raise TransferError(f"{encoder_addr} sent embeddings of shape {tuple(tensor.shape)}, not 2-D")
        except BaseException as e:
            self._fail(e, encoder_addr, mm_hash)
        self.stats.record(tensor.nbytes, started)
        return tensor

    async def _fetch_embeddings(self, client: RequestClient, mm_hash: str, deadline: float) -> torch.Tensor:
        reply = await client.request(FetchEmbeddings(mm_hash), timeout=self._remaining(deadline), expect=EmbeddingsData)
        if reply.mm_hash != mm_hash:
            raise TransferError(f"{client.address} answered with embeddings of {reply.mm_hash!r}")
        return reply.data

    def _fail(self, error: BaseException, address: str, mm_hash: str | None = None) -> typing.NoReturn:
        """Count a failed fetch and raise it as a TransferError subclass."""
        self.stats.num_failures += 1
        typed = _as_transfer_error(error, address, mm_hash)
        if typed is error:
            raise error
        raise typed from error

    async def close(self) -> None:
        await self._clients.close()
        await self._stream.close()


def _host(address: str) -> str:
    """The host of a ZMQ endpoint tcp://host:port (IPv6 without its brackets)."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")


# Blocks gathered for want of runs travel in messages of at most this size: each is gathered into a
# fresh buffer on the server and received into one on the client, which glibc reuses below its mmap
# threshold (32 MiB) instead of faulting in fresh pages on every message.
GATHERED_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Chunk:
    """One fetch message: the (remote, local) run pairs it moves, as runs or gathered."""

    pairs: list[tuple[Run, Run]]
    gathered: bool

    @property
    def remote_ids(self) -> tuple[int, ...]:
        return tuple(i for remote, _ in self.pairs for i in range(remote.first, remote.first + remote.length))

    @property
    def local_ids(self) -> list[int]:
        return [i for _, local in self.pairs for i in range(local.first, local.first + local.length)]

    @property
    def local_runs(self) -> list[Run]:
        return [local for _, local in self.pairs]

    def request(self, request_id: str, ucx_tag: int | None = None) -> FetchBlocks:
        run_lengths = () if self.gathered else tuple(remote.length for remote, _ in self.pairs)
        return FetchBlocks(request_id, self.remote_ids, run_lengths, ucx_tag=ucx_tag)


def _split(pairs: list[tuple[Run, Run]], blocks_per_message: int) -> list[list[tuple[Run, Run]]]:
    """Run pairs grouped into messages of at most `blocks_per_message` blocks; a longer run is cut
    (any stretch of a run is a run on both sides)."""
    messages: list[list[tuple[Run, Run]]] = [[]]
    room = blocks_per_message
    for remote, local in pairs:
        done = 0
        while done < remote.length:
            if room == 0:
                messages.append([])
                room = blocks_per_message
            n = min(room, remote.length - done)
            messages[-1].append((Run(remote.first + done, n), Run(local.first + done, n)))
            done += n
            room -= n
    return [m for m in messages if m]


def _as_transfer_error(error: BaseException, address: str, mm_hash: str | None = None) -> BaseException:
    """The TransferError subclass for a failure below the transfer layer (others pass through)."""
    if isinstance(error, TransferError) or not isinstance(error, Exception):
        return error  # already typed, or cancellation / interpreter exit: never mask those
    if isinstance(error, ChannelTimeout):
        return TransferTimeout(f"{address}: {error}")
    if isinstance(error, HandshakeError):
        return IncompatiblePeerError(str(error))
    if isinstance(error, ErrorReply):
        code = error.error.code
        if code is ErrorCode.NOT_FOUND:
            return EmbeddingNotFoundError(error.error.message) if mm_hash else BlocksNotFoundError(error.error.message)
        if code is ErrorCode.OUT_OF_RANGE:
            return BlockRangeError(f"{address}: {error.error.message}")
        if code is ErrorCode.INCOMPATIBLE:
            return IncompatiblePeerError(f"{address}: {error.error.message}")
    if isinstance(error, (ChannelError, codec.DecodeError)):
        return TransferError(f"{address}: {error}")
    return error
