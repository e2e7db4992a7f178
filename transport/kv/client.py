"""`KVTransferClient`: pulls a server's blocks into the local KV cache, and embeddings by mm_hash, over the
data paths it was built with (`ClientPath`s, base.py: the counterparts of the server's, server.py).

What every path shares is here: one control connection per server address (a RequestClient, handshaken on
first use, reused, closed once unused), the handshake's checks, and how a fetch is planned - remote and
local block ids paired into runs consecutive on both sides, runs too short to move alone gathered, all cut
into a few large messages of which up to `max_inflight_messages` are in flight. Each message goes by the
first path usable with that peer (`ClientPath.usable`): UCX for a UCX client; for a ZMQ one, block
connections when the server offers them and the cache is on the CPU, else ZMQ frames.

Every path hands what landed to `land` (blocks) or returns it to `fetch_embeddings`, which compare the
checksums of the bytes in place with those the server sent (checksum.py): a mismatch fails the fetch with
IntegrityError. A fetch carries its handle's generation, and the server refuses it with StaleHandleError
once the blocks the handle names were released.

`stats` counts bytes, seconds and failures of every fetch. A failed fetch leaves the local blocks it was
writing undefined: the caller frees them (or computes them itself), or fetches again (FETCHING, then FETCHED or
FAILED: states.py). `transports.create_client` assembles the paths of a transport.
"""
from __future__ import annotations

import asyncio
import functools
import time
import typing
from collections.abc import Awaitable, Callable, Sequence

import torch

from epdserve.transport.channel import codec, peer_pool
from epdserve.transport.channel.common import (ChannelError, ChannelTimeout, ConnectionLost, ErrorReply,
                                                HandshakeError, PeerUnreachable)
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.peer_pool import PeerPool
from epdserve.transport.channel.protocol import ErrorCode, FetchBlocks, HandshakeAck, KVLayout, Role
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.channel.security import CurveConfig
from epdserve.transport.kv import checksum
from epdserve.transport.kv.base import Chunk, ClientPath
from epdserve.transport.kv.transfer import (BlockRangeError, BlocksNotFoundError, EmbeddingNotFoundError, FetchResult,
                                            IncompatiblePeerError, PeerUnreachableError, Run, StaleHandleError,
                                            TransferError, TransferStats, TransferTimeout, as_bytes, block_index,
                                            common_runs, kv_layout, layout_mismatch, run_segments, run_views,
                                            scatter_blocks, transport_mismatch)

# Blocks gathered for want of runs travel in messages of at most this size: each is gathered into a
# fresh buffer on the server and received into one on the client, which glibc reuses below its mmap
# threshold (32 MiB) instead of faulting in fresh pages on every message.
GATHERED_MESSAGE_BYTES = 16 << 20
# Seconds a connection to a server may take before the fetch fails (PeerUnreachableError), however long the
# fetch itself may take: a server that is gone holds nothing of what was asked (a restarted one neither), so
# its fetch fails within this and is made good elsewhere (blocks recomputed, an image encoded again) rather
# than waiting out the transfer timeout. A refused connection fails it at once.
CONNECT_TIMEOUT = 5.0


T = typing.TypeVar("T")


class KVTransferClient:
    """See the module docstring. `kv_cache`: [num_layers, 2, num_blocks, *block] (None: embeddings only)."""

    def __init__(self, engine_id: str, paths: Sequence[ClientPath], *, kv_cache: torch.Tensor | None = None,
                 model_id: str = "", layout: KVLayout | None = None, role: Role = Role.DECODE, timeout: float = 30.0,
                 curve: CurveConfig | None = None, auth: PeerAuth | None = None, limits: Limits = DEFAULT_LIMITS,
                 max_message_bytes: int = 256 << 20, min_message_bytes: int = 64 << 20,
                 max_inflight_messages: int = 2, min_segment_bytes: int = 64 << 10,
                 peer_idle_seconds: float = peer_pool.IDLE_SECONDS, connect_timeout: float = CONNECT_TIMEOUT):
        transports = {path.transport for path in paths}
        assert len(transports) == 1, f"the paths of one client move data over one transport, not {transports}"
        self.engine_id = engine_id
        self.transport = transports.pop()
        self.paths = list(paths)
        self.kv_cache = kv_cache
        self.layout = kv_layout(kv_cache, model_id, layout) if kv_cache is not None else None
        self.stats = TransferStats()
        self.role, self.timeout, self.limits, self._curve, self._auth = role, timeout, limits, curve, auth
        self.connect_timeout = connect_timeout
        # Large messages: runs cost no gather, so a message costs a round trip and Python work per segment,
        # and few large ones measured fastest (64-256 MiB x 2 in flight on 2 cores).
        self.max_message_bytes = max_message_bytes
        self.min_message_bytes = min_message_bytes
        self.max_inflight_messages = max_inflight_messages
        # A run whose segments are smaller than this travels gathered: pyzmq copies frames under 64 KiB
        # anyway, and per-segment costs outweigh one gather and one scatter.
        self.min_segment_bytes = min_segment_bytes
        self.peer_idle_seconds = peer_idle_seconds
        # address -> control connection, reused across fetches, closed once unused (servers come and go)
        self._controls: PeerPool[str, RequestClient] = PeerPool(self._open_control, RequestClient.close,
                                                                idle_seconds=peer_idle_seconds)
        for path in self.paths:
            path.bind(self)

    def _open_control(self, address: str) -> RequestClient:
        extra = {key: value for path in self.paths for key, value in path.hello_extra().items()}
        return RequestClient(address, engine_id=self.engine_id, role=self.role, timeout=self.timeout,
                             curve=self._curve, auth=self._auth, limits=self.limits, kv_layout=self.layout,
                             kv_transport=self.transport, check_ack=self._check_ack, fail_if_refused=True, **extra)

    def _check_ack(self, ack: HandshakeAck) -> str | None:
        refusal = transport_mismatch(self.transport, ack.kv_transport, self.engine_id, ack.engine_id)
        if refusal is None and self.layout is not None and ack.kv_layout is not None:
            refusal = layout_mismatch(self.layout, ack.kv_layout, self.engine_id, ack.engine_id)
        return refusal

    def remaining(self, deadline: float) -> float:
        return max(deadline - asyncio.get_running_loop().time(), 0.0)

    async def _connect(self, control: RequestClient, deadline: float) -> HandshakeAck:
        """The server's handshake answer, connecting first if need be: within `connect_timeout` (and the
        fetch's deadline), at once PeerUnreachable if the connection is refused."""
        if control.peer is not None:
            return control.peer
        remaining = self.remaining(deadline)
        try:
            return await control.connect(min(self.connect_timeout, remaining))
        except ChannelTimeout as exc:
            if remaining <= self.connect_timeout:
                raise
            raise PeerUnreachableError(f"no connection to {control.address} within {self.connect_timeout:g}s: "
                                       f"{exc}") from exc

    # -- blocks -----------------------------------------------------------------------------------------
    def runs(self, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[tuple[Run, Run]]:
        """The (remote, local) run pairs of a fetch, local ids checked against this cache."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.engine_id} has no KV cache to fetch into")
        if len(remote_block_ids) != len(local_block_ids):
            raise BlockRangeError(f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local ones")
        block_index(local_block_ids, self.kv_cache.shape[2], "local", unique=True)
        return common_runs(list(map(int, remote_block_ids)), list(map(int, local_block_ids)))

    async def fetch_blocks(self, kv_addr: str, request_id: str, remote_block_ids: Sequence[int],
                           local_block_ids: Sequence[int], *, generation: int,
                           timeout: float | None = None) -> FetchResult:
        """Copy remote blocks `remote_block_ids` (exposed under `request_id` with `generation`: the KV
        handle's) into local `local_block_ids`, pairwise. Raises a TransferError subclass on any failure:
        IntegrityError when bytes landed corrupted, StaleHandleError when the handle's blocks were released."""
        pairs = self.runs(remote_block_ids, local_block_ids)
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)
        chunks = self._messages(pairs)
        connect_seconds = 0.0

        async def fetch() -> int:
            nonlocal connect_seconds
            with self._controls.holding(kv_addr) as control:
                if control.peer is None:
                    await self._connect(control, deadline)
                    connect_seconds = time.perf_counter() - started
                if control.peer.kv_layout != self.layout:
                    raise IncompatiblePeerError(f"{kv_addr} ({control.peer.engine_id}) has no matching KV cache")
                return sum(await self._bounded(
                    [functools.partial(self._fetch_chunk, control, chunk.request(request_id, generation), chunk,
                                       deadline) for chunk in chunks]))

        try:
            num_bytes = await self._once_more_if_lost(fetch)
        except BaseException as e:
            self._fail(e, kv_addr)
        return self.stats.record(num_bytes, started, connect_seconds)

    async def _once_more_if_lost(self, fetch: Callable[[], Awaitable[T]]) -> T:
        """`fetch()`, made once more if its connection dropped meanwhile: a peer that only missed heartbeats
        (frozen for a moment, or starved of CPU) still holds what it exposed, and is asked again once
        reconnected; one that died refuses the reconnect at once, and one restarted knows the request no more."""
        try:
            return await fetch()
        except ConnectionLost:
            self.stats.num_retries += 1
        return await fetch()

    async def _fetch_chunk(self, control: RequestClient, request: FetchBlocks, chunk: Chunk, deadline: float) -> int:
        # Handshaken again if the connection dropped since the fetch began (a restarted server has a new port).
        peer = await self._connect(control, deadline)
        path = next((path for path in self.paths if path.usable(peer)), None)
        if path is None:
            raise IncompatiblePeerError(f"{control.address} offers no data path this client can use")
        return await path.fetch_chunk(control, request, chunk, deadline)

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

    def landing(self, chunk: Chunk) -> tuple[list, torch.Tensor | None]:
        """Flat bytes a message's segments are received into (as the server's `segment_bytes`): the
        destination blocks themselves, or for gathered blocks one new tensor - returned too, to scatter
        from."""
        if chunk.gathered:
            gathered = torch.empty(self.gathered_shape(chunk), dtype=self.kv_cache.dtype, device=self.kv_cache.device)
            return [as_bytes(gathered)], gathered
        if self.kv_cache.device.type == "cpu":
            return run_views(self.kv_cache, chunk.local_runs), None
        return [as_bytes(segment) for segment in run_segments(self.kv_cache, chunk.local_runs)], None

    def land(self, chunk: Chunk, buffers: Sequence, sent: Sequence[int], *, landed: Sequence[int] | None = None,
             gathered: torch.Tensor | None = None, source: str = "") -> int:
        """A message's segments are in place in `buffers` (flat bytes, in FetchBlocks' order: the destination
        blocks, or the one gathered buffer): compare their checksums (`landed`, when the path took them as
        they arrived) with those the server `sent` - IntegrityError unless all match - then scatter
        `gathered` blocks into the cache. The bytes received."""
        if landed is None:
            landed = checksum.checksums(buffers)
        checksum.verify(sent, landed, f"blocks from {chunk.pairs[0][0].first} on of {source or 'the peer'}")
        if gathered is not None:
            scatter_blocks(self.kv_cache, chunk.local_ids, gathered)
        return sum(buffer.nbytes for buffer in buffers)

    def gathered_shape(self, chunk: Chunk) -> torch.Size:
        """The one segment a gathered message's blocks travel in: [layers, 2, n, *block], as our cache's."""
        return torch.Size((self.kv_cache.shape[0], 2, sum(local.length for local in chunk.local_runs),
                           *self.kv_cache.shape[3:]))

    # -- embeddings -------------------------------------------------------------------------------------
    async def fetch_embeddings(self, encoder_addr: str, mm_hash: str, *, timeout: float | None = None) -> torch.Tensor:
        """The [num_tokens, hidden_size] embeddings the encoder at `encoder_addr` holds for `mm_hash`."""
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)
        path = next(path for path in self.paths if path.fetches_embeddings)

        async def fetch() -> tuple[torch.Tensor, int]:
            with self._controls.holding(encoder_addr) as control:
                await self._connect(control, deadline)
                return await path.fetch_embeddings(control, mm_hash, deadline)

        try:
            tensor, sent = await self._once_more_if_lost(fetch)
            if tensor.dim() != 2:
                raise TransferError(f"{encoder_addr} sent embeddings of shape {tuple(tensor.shape)}, not 2-D")
            checksum.verify((sent,), (checksum.checksum(as_bytes(tensor)),),
                            f"embeddings {mm_hash[:16]}... from {encoder_addr}")
        except BaseException as e:
            self._fail(e, encoder_addr, mm_hash)
        self.stats.record(tensor.nbytes, started)
        return tensor

    def _fail(self, error: BaseException, address: str, mm_hash: str | None = None) -> typing.NoReturn:
        """Count a failed fetch and raise it as a TransferError subclass."""
        self.stats.num_failures += 1
        typed = _as_transfer_error(error, address, mm_hash)
        if typed is error:
            raise error
        raise typed from error

    async def close(self) -> None:
        await self._controls.close()
        for path in self.paths:
            await path.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _split(pairs: list[tuple[Run, Run]], blocks_per_message: int) -> list[list[tuple[Run, Run]]]:
    """Run pairs grouped into messages of at most `blocks_per_message` blocks; a longer run is cut (any
    stretch of a run is a run on both sides)."""
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
    if isinstance(error, PeerUnreachable):
        return PeerUnreachableError(str(error))
    if isinstance(error, HandshakeError):
        return IncompatiblePeerError(str(error))
    if isinstance(error, ErrorReply):
        code = error.error.code
        if code is ErrorCode.STALE:
            return StaleHandleError(f"{address}: {error.error.message}")
        if code is ErrorCode.NOT_FOUND:
            return EmbeddingNotFoundError(error.error.message) if mm_hash else BlocksNotFoundError(error.error.message)
        if code is ErrorCode.OUT_OF_RANGE:
            return BlockRangeError(f"{address}: {error.error.message}")
        if code is ErrorCode.INCOMPATIBLE:
            return IncompatiblePeerError(f"{address}: {error.error.message}")
    if isinstance(error, (ChannelError, codec.DecodeError)):
        return TransferError(f"{address}: {error}")
    return error
