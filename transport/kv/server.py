"""`KVTransferServer`: serves the blocks a local engine exposes and the embeddings its encoder cache holds, to
peers that handshook on its control channel (a typed ZMQ channel), over the data paths it was built with.

What every path shares is here: the control channel and its handshake checks (transport, KV layout), the
requests' blocks exposed while held and withdrawn on release, the checks of every fetch against them, and
the segments' bytes as the cache holds them. How those bytes travel is a `ServerPath`'s business (base.py),
and none knows another: ZMQ frames (transport/zmq_frames/), plain TCP block connections
(transport/block_stream/), UCX (transport/ucx/). Each path sends the checksum of every segment (and embedding
tensor) it sends, taken over the bytes as they leave (just before, or piece by piece once a socket copied
them: checksum.py). `transports.create_server` assembles the paths of a transport.

`expose` / `withdraw` are called by the engine's loop (the owner of the blocks and their leases); the
server only reads exposed blocks, never frees or writes any. Each exposure gets a generation of its own,
which the handle carries and every fetch must carry back: a fetch is served only while its request's
blocks are exposed under that very generation, so a handle outlives neither a release nor a new exposure
of the same request id. `state` says where a request's blocks stand (states.py): EXPOSED, FETCHING while a
path's send reads them, STALE for a handle of another exposure, and once withdrawn RELEASING until no send
reads them any more, then RELEASED. A path checks a fetch and marks its send as reading the blocks
(`sending`) with nothing in between that a withdraw could run in: off the loop under `lock`, which
`withdraw` holds too; on the loop without an await. The owner frees a withdrawn request's blocks only once
`wait_sent` says they are RELEASED - sends that outlast its timeout are cut, and waited for still.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq

from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.protocol import (MAY_SEND, Error, ErrorCode, FetchBlocks, FetchEmbeddings, Handshake,
                                                 KVLayout, Message)
from epdserve.transport.channel.reply_server import ReplyServer
from epdserve.transport.channel.security import CurveConfig
from epdserve.transport.kv.base import ServerPath
from epdserve.transport.kv.states import HandoffState
from epdserve.transport.kv.transfer import (BlockRangeError, BlocksNotFoundError, EmbeddingNotFoundError,
                                            EmbeddingSource, IncompatiblePeerError, Run, StaleHandleError,
                                            TransferError, TransferStats, as_bytes, block_index, gather_blocks,
                                            kv_layout, layout_mismatch, run_segments, run_views, split_runs,
                                            transport_mismatch)

logger = logging.getLogger(__name__)

_ERROR_CODES = {
    BlockRangeError: ErrorCode.OUT_OF_RANGE,
    BlocksNotFoundError: ErrorCode.NOT_FOUND,
    StaleHandleError: ErrorCode.STALE,
    EmbeddingNotFoundError: ErrorCode.NOT_FOUND,
    IncompatiblePeerError: ErrorCode.INCOMPATIBLE,
}


def error_reply(error: TransferError, request_id: str | None = None) -> ErrorReply:
    return ErrorReply(Error(_ERROR_CODES.get(type(error), ErrorCode.INTERNAL), str(error), request_id))


# The states in which a send reads a request's blocks: they must not be freed.
_READ = frozenset({HandoffState.FETCHING, HandoffState.RELEASING})


@dataclass(frozen=True, slots=True)
class _Exposure:
    """What `expose` made readable: the generation fetches must carry, and the block ids they may name."""

    generation: int
    block_ids: frozenset[int]


def _exposure_state(exposure: _Exposure | None, generation: int | None) -> HandoffState:
    """EXPOSED, STALE or RELEASED: what a fetch of a handle of `generation` is checked against (the sends that
    read the blocks aside)."""
    if exposure is None:
        return HandoffState.RELEASED
    if generation is not None and generation != exposure.generation:
        return HandoffState.STALE
    return HandoffState.EXPOSED


class KVTransferServer:
    """See the module docstring. `kv_cache`: [num_layers, 2, num_blocks, *block] (an encoder has none);
    `encoder_cache`: what serves embeddings (an engine has none)."""

    def __init__(self, engine_id: str, paths: Sequence[ServerPath], *, kv_cache: torch.Tensor | None = None,
                 model_id: str = "", encoder_cache: EmbeddingSource | None = None, layout: KVLayout | None = None,
                 host: str = "127.0.0.1", port: int = 0, allow_wildcard: bool = False,
                 curve: CurveConfig | None = None, auth: PeerAuth | None = None, limits: Limits = DEFAULT_LIMITS,
                 max_inflight: int = 8):
        transports = {path.transport for path in paths}
        assert len(transports) == 1, f"the paths of one server move data over one transport, not {transports}"
        self.engine_id = engine_id
        self.transport = transports.pop()
        self.paths = list(paths)
        self.kv_cache = kv_cache
        self.layout = kv_layout(kv_cache, model_id, layout) if kv_cache is not None else None
        self.encoder_cache = encoder_cache
        self.stats = TransferStats()  # bytes served
        self.lock = threading.Lock()  # a path's off-loop check of a fetch and the start of its send; withdraw
        # request id -> its exposure (EXPOSED or FETCHING); only these blocks may be read by peers.
        self._exposed: dict[str, _Exposure] = {}
        # Generations: consecutive from a random start, so that a handle from before a restart of the server
        # (or from another server at the same address) does not match either.
        self._generations = itertools.count(secrets.randbits(62) + 1)
        self.control = ReplyServer(engine_id, host=host, port=port, allow_wildcard=allow_wildcard, curve=curve,
                                   auth=auth, limits=limits, kv_layout=self.layout, kv_transport=self.transport,
                                   on_sent=self._on_sent, check_handshake=self._check_peer, max_inflight=max_inflight,
                                   senders=MAY_SEND, ack_extra=self._ack_extra)
        self._serve_task: asyncio.Task | None = None
        for path in self.paths:
            path.bind(self)

    @property
    def address(self) -> str:
        return self.control.address

    @property
    def num_rejected(self) -> int:
        """Frames the control channel dropped (malformed, oversized, other version), and what the paths
        refused (a block connection with a wrong token, say)."""
        return self.control.num_rejected + sum(path.num_rejected for path in self.paths)

    @property
    def num_auth_denied(self) -> int:
        return self.control.num_auth_denied

    async def start(self) -> str:
        """Start serving; the address peers fetch from (what KVHandle.kv_addr carries)."""
        for path in self.paths:  # before the first handshake, whose answer may name what they opened
            await path.start()
        address = await self.control.start()
        if self._serve_task is None:
            self._serve_task = asyncio.create_task(self.control.serve(self._handle))
        return address

    async def close(self) -> None:
        if self._serve_task is not None:
            self._serve_task.cancel()
            self._serve_task = None
        await self.control.close()
        for path in self.paths:
            await path.close()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- what peers may read --------------------------------------------------------------------------
    def expose(self, request_id: str, block_ids: Sequence[int]) -> int:
        """Let peers fetch `block_ids` under `request_id` (EXPOSED, until withdraw); the exposure's generation,
        which their fetches must carry (KVHandle.generation)."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.engine_id} has no KV cache to expose")
        block_index(block_ids, self.kv_cache.shape[2], f"expose {request_id}")
        generation = next(self._generations)
        with self.lock:
            self._exposed[request_id] = _Exposure(generation, frozenset(block_ids))
        return generation

    def generation(self, request_id: str) -> int | None:
        """The generation the request's blocks are exposed under; None when they are not exposed."""
        exposure = self._exposed.get(request_id)
        return exposure.generation if exposure is not None else None

    def withdraw(self, request_id: str) -> None:
        """Stop serving the request's blocks (released, aborted or lease expired): RELEASING while a send still
        reads them, else RELEASED."""
        with self.lock:
            self._exposed.pop(request_id, None)

    def state(self, request_id: str, generation: int | None = None) -> HandoffState:
        """Where the request's blocks stand here for a handle of `generation` (None: of whichever exposure):
        EXPOSED, or FETCHING while a send reads them; STALE when they are exposed under another generation;
        not exposed (withdrawn, or never exposed), RELEASING while a send still reads them, else RELEASED.
        Not to be called under `lock` (a path's `sending` may take it)."""
        state = _exposure_state(self._exposed.get(request_id), generation)
        if state is not HandoffState.STALE and any(path.sending(request_id) for path in self.paths):
            return HandoffState.FETCHING if state is HandoffState.EXPOSED else HandoffState.RELEASING
        return state

    async def wait_sent(self, request_id: str, timeout: float = 60.0) -> bool:
        """Wait until no send still reads the request's blocks (neither FETCHING nor RELEASING): blocks go out
        straight from the cache, so the engine frees withdrawn blocks only once they are RELEASED. Sends still
        reading them after `timeout` (a peer that stopped reading) are cut, and waited for until they no
        longer read them: a block is never freed under a send. False if it had to cut some."""
        deadline = time.monotonic() + timeout
        cut, warned = False, deadline + timeout
        while self.state(request_id) in _READ:
            now = time.monotonic()
            if now > deadline:
                cut = True
                for path in self.paths:
                    path.abort(request_id)  # the peer's fetch fails rather than read freed blocks
                if now > warned:
                    logger.warning("%s: a send of %s's blocks outlived its cut; they stay held until it ends",
                                   self.engine_id, request_id)
                    warned = now + timeout
            await asyncio.sleep(0.01 if cut else 0.001)
        return not cut

    def check_exposed(self, request_id: str, generation: int, block_ids: Sequence[int]) -> None:
        """Refuse a fetch of blocks not exposed for the request under `generation`: BlocksNotFoundError when it
        is RELEASED, StaleHandleError when the handle is STALE (exposed ids were checked by `expose`)."""
        exposure = self._exposed.get(request_id)
        state = _exposure_state(exposure, generation)
        if state is HandoffState.RELEASED:
            raise BlocksNotFoundError(f"{self.engine_id} holds no blocks for request {request_id!r}")
        if state is HandoffState.STALE:
            raise StaleHandleError(f"{self.engine_id}: the blocks of request {request_id!r} that the handle "
                                   f"names (generation {generation}) were released; it exposes generation "
                                   f"{exposure.generation} now")
        if not exposure.block_ids.issuperset(block_ids):
            raise BlockRangeError(f"request {request_id!r}: asked for blocks not exposed for it")

    def embeddings(self, mm_hash: str) -> torch.Tensor:
        tensor = self.encoder_cache.get(mm_hash) if self.encoder_cache is not None else None
        if tensor is None:
            raise EmbeddingNotFoundError(f"{self.engine_id} has no embeddings for mm_hash {mm_hash!r}")
        return tensor

    # -- a fetch's segments, as the cache holds them ----------------------------------------------------
    def runs(self, message: FetchBlocks) -> list[Run] | None:
        """The runs FetchBlocks cuts its blocks into (None: gathered); ErrorReply when it asks for blocks not
        exposed for its request or cuts them into bad runs."""
        try:
            self.check_exposed(message.request_id, message.generation, message.block_ids)
            return split_runs(message.block_ids, message.run_lengths) if message.run_lengths else None
        except TransferError as e:
            raise error_reply(e, message.request_id) from None

    def segments(self, message: FetchBlocks) -> list[torch.Tensor]:
        """The segments FetchBlocks describes, as views of the cache (gathered: a copy)."""
        runs = self.runs(message)
        return (run_segments(self.kv_cache, runs) if runs is not None
                else [gather_blocks(self.kv_cache, message.block_ids)] if message.block_ids else [])

    def segment_bytes(self, message: FetchBlocks) -> list:
        """The segments as flat bytes of the cache's memory, for a socket or UCX to send: numpy views of a
        CPU cache (cheaper than a tensor view each), device tensors of a GPU one."""
        runs = self.runs(message)
        if runs is None:
            return [as_bytes(gather_blocks(self.kv_cache, message.block_ids))] if message.block_ids else []
        if self.kv_cache.device.type == "cpu":
            return run_views(self.kv_cache, runs)
        return [as_bytes(segment) for segment in run_segments(self.kv_cache, runs)]

    # -- the control channel ----------------------------------------------------------------------------
    def _ack_extra(self, hello: Handshake) -> dict:
        return {key: value for path in self.paths for key, value in path.ack_extra(hello).items()}

    async def _check_peer(self, hello: Handshake) -> str | None:
        refusal = transport_mismatch(self.transport, hello.kv_transport, self.engine_id, hello.engine_id)
        if refusal is None and self.layout is not None and hello.kv_layout is not None:
            refusal = layout_mismatch(self.layout, hello.kv_layout, self.engine_id, hello.engine_id)
        for path in self.paths:
            refusal = refusal or await path.check_peer(hello)
        return refusal

    def _on_sent(self, reply: Message, tracker: zmq.MessageTracker) -> None:
        for path in self.paths:
            path.on_sent(reply, tracker)

    def _path_for(self, message: FetchBlocks | FetchEmbeddings) -> ServerPath:
        path = next((path for path in self.paths if path.serves(message)), None)
        if path is None:
            raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"{self.engine_id} has no data path for this fetch "
                                                          f"(it moves data over {self.transport})",
                                   getattr(message, "request_id", None)))
        return path

    async def _handle(self, message: Message, peer: Handshake) -> Message:
        if isinstance(message, FetchBlocks):
            if self.layout is None or peer.kv_layout != self.layout:
                raise ErrorReply(Error(ErrorCode.INCOMPATIBLE, "no KV layout agreed in the handshake",
                                       message.request_id))
            started = time.perf_counter()
            reply, num_bytes = await self._path_for(message).reply_blocks(message, peer)
            self.stats.record(num_bytes, started)
            return reply
        if isinstance(message, FetchEmbeddings):
            path = self._path_for(message)
            try:
                tensor = self.embeddings(message.mm_hash)
            except TransferError as e:
                raise error_reply(e) from None
            reply = await path.reply_embeddings(message, peer, tensor)
            self.stats.num_bytes += tensor.nbytes
            self.stats.num_transfers += 1
            return reply
        raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"{self.engine_id} serves block and embedding fetches only"))

