"""KVTransfer: how engines hand each other paged KV-cache blocks and encoder embeddings.

An engine's KV cache is one tensor
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]   (dim 1: K, V)
and a block is `kv_cache[:, :, block_id]`. A prefill engine runs a KVTransferServer, exposes each
request's blocks while it holds them under a lease, and withdraws them on release; a decode engine's
KVTransferClient pulls given remote block ids into given local block ids. An encoder's server exposes
its encoder cache (mm_hash -> [num_tokens, hidden_size]) the same way.

Before any block moves the two sides compare KVLayout (model id, dtype, block size, layers, KV heads,
head size) in the connection handshake. Block ids and sizes that come from the wire are checked
against the local cache on both sides: a server serves only blocks it exposed for that request, and
a client writes only blocks it named, with exactly the shape its own cache has.

Blocks move as runs: a client pairs remote and local block ids into runs consecutive on both sides
(`common_runs`; the block manager allocates so that a request's blocks usually are), and each run
moves as one segment per layer and K/V, straight from the server's cache memory into the client's -
no gather or scatter buffer on either side. Blocks in runs too short for that (a segment per block,
layer and K/V costs more per byte than copying it) are gathered into one segment instead.

Backends: `zmq_kv` (default; segments as zero-copy ZMQ frames) and `ucx_kv` (segments as UCX tagged
messages received into the cache; control over the same ZMQ channel). `create_server` /
`create_client` pick one by name; both ends of a transfer must use the same one, which the
handshake checks.
"""
from __future__ import annotations

import abc
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

import numpy as np
import torch

from epdserve.transport.protocol import KVLayout
from epdserve.transport.tensor_frames import dtype_name


class TransferError(Exception):
    """A transfer failed; the local blocks it was writing hold no usable data."""


class IncompatiblePeerError(TransferError):
    """The peer's protocol version or KV layout differs from ours (or it refused our keys)."""


class BlockRangeError(TransferError, ValueError):
    """Block ids outside the cache, not exposed for the request, duplicated, or mismatched in count."""


class BlocksNotFoundError(TransferError):
    """The server exposes no blocks for the request (released, or its lease expired)."""


class EmbeddingNotFoundError(TransferError):
    """The encoder cache holds no embeddings for the mm_hash (never encoded, or evicted)."""


class TransferTimeout(TransferError, TimeoutError):
    """The peer did not deliver in time (dead, unreachable or overloaded)."""


class FetchResult(NamedTuple):
    num_bytes: int
    seconds: float
    connect_seconds: float = 0.0  # of `seconds`: connecting and the handshake, when the fetch had to connect


@dataclass(slots=True)
class TransferStats:
    """Cumulative counters of one client or server; the services export them as metrics."""

    num_bytes: int = 0
    seconds: float = 0.0
    num_transfers: int = 0
    num_failures: int = 0

    def record(self, num_bytes: int, started: float, connect_seconds: float = 0.0) -> FetchResult:
        result = FetchResult(num_bytes, time.perf_counter() - started, connect_seconds)
        self.num_bytes += result.num_bytes
        self.seconds += result.seconds
        self.num_transfers += 1
        return result


def kv_layout(kv_cache: torch.Tensor, model_id: str, layout: KVLayout | None = None) -> KVLayout:
    """The layout of a KV cache tensor [num_layers, 2, num_blocks, *block] (contiguous).

    Without `layout`, the block is read as [block_size, num_kv_heads, head_size]. An engine that
    stores blocks in another order (head-major, say) passes its `layout`; it must describe the same
    number of elements per block. Either way a block moves as its raw bytes.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [layers, 2, blocks, *block (3 dims)], got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if layout is None:
        num_layers, _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        return KVLayout(model_id, dtype_name(kv_cache.dtype), block_size, num_layers, num_kv_heads, head_size)
    per_block = layout.block_size * layout.num_kv_heads * layout.head_size
    if (layout.num_layers != kv_cache.shape[0] or layout.dtype != dtype_name(kv_cache.dtype)
            or per_block != kv_cache[0, 0, 0].numel()):
        raise ValueError(f"layout {layout} does not describe a cache of shape {tuple(kv_cache.shape)} "
                         f"and dtype {kv_cache.dtype}")
    return layout


def layout_mismatch(ours: KVLayout, theirs: KVLayout, us: str = "here", them: str = "peer") -> str | None:
    """Why two layouts are incompatible (naming both sides), or None if they match."""
    diffs = [
        f"{f.name}: {us} has {getattr(ours, f.name)!r}, {them} has {getattr(theirs, f.name)!r}"
        for f in fields(KVLayout)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    ]
    return "; ".join(diffs) or None


def block_index(block_ids: Sequence[int], num_blocks: int, what: str, unique: bool = False) -> None:
    """Check that every block id is an integer in [0, num_blocks) (and, with `unique`, that none repeats).
    Plain Python: a fetch checks its ids on its way to the socket, where torch's per-call cost showed."""
    try:
        ids = [operator.index(i) for i in block_ids]
    except TypeError as e:
        raise BlockRangeError(f"{what}: block ids are not integers ({e})") from None
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise BlockRangeError(f"{what}: block ids outside [0, {num_blocks})")
    if unique and len(set(ids)) != len(ids):
        # Two segments written into one block: which one lands is unspecified.
        raise BlockRangeError(f"{what}: block ids repeat")


class Run(NamedTuple):
    """Consecutive blocks: `first`, first + 1, ..., first + length - 1."""

    first: int
    length: int


def common_runs(remote_ids: Sequence[int], local_ids: Sequence[int]) -> list[tuple[Run, Run]]:
    """The pairs (remote run, local run) of equal length that map `remote_ids` onto `local_ids`
    pairwise: maximal stretches where both sides' ids are consecutive. A stretch moves as one
    contiguous copy per layer and K/V, so the fewer the runs the fewer the copies and frames."""
    pairs: list[tuple[Run, Run]] = []
    start = 0
    for i in range(1, len(remote_ids) + 1):
        if (i == len(remote_ids) or remote_ids[i] != remote_ids[i - 1] + 1
                or local_ids[i] != local_ids[i - 1] + 1):
            pairs.append((Run(remote_ids[start], i - start), Run(local_ids[start], i - start)))
            start = i
    return pairs


def split_runs(block_ids: Sequence[int], run_lengths: Sequence[int]) -> list[Run]:
    """`block_ids` cut into runs of `run_lengths`; BlockRangeError unless every run is consecutive and
    non-empty and the lengths add up to len(block_ids)."""
    if sum(run_lengths) != len(block_ids) or any(n <= 0 for n in run_lengths):
        raise BlockRangeError(f"run lengths {list(run_lengths[:8])}... do not cut {len(block_ids)} blocks into runs")
    runs, i = [], 0
    for n in run_lengths:
        first = block_ids[i]
        if tuple(block_ids[i:i + n]) != tuple(range(first, first + n)):
            raise BlockRangeError(f"blocks {list(block_ids[i:i + min(n, 8)])}... are not consecutive")
        runs.append(Run(first, n))
        i += n
    return runs


def run_segments(kv_cache: torch.Tensor, runs: Sequence[Run]) -> list[torch.Tensor]:
    """Views of the cache, one per run, layer and K/V (in that order): kv_cache[layer, kv, run].
    Each is contiguous memory of the cache itself: sending or receiving one copies nothing else."""
    num_layers = kv_cache.shape[0]
    return [kv_cache[layer, kv, run.first:run.first + run.length]
            for run in runs for layer in range(num_layers) for kv in (0, 1)]


def run_views(kv_cache: torch.Tensor, runs: Sequence[Run]) -> list[np.ndarray]:
    """The segments of `run_segments`, in its order, as flat uint8 numpy views of a CPU cache's memory:
    what a socket sends from or receives into, at a fraction of a tensor view's cost each."""
    rows = kv_cache.view(torch.uint8).numpy().reshape(kv_cache.shape[0] * 2, kv_cache.shape[2], -1)
    return [rows[i, run.first:run.first + run.length].reshape(-1) for run in runs for i in range(rows.shape[0])]


# Integer dtype of each element size: block copies move bits, and numpy lacks bfloat16 and float8.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bytes(tensor: torch.Tensor):
    """A contiguous tensor's memory as a flat uint8 array: numpy for CPU memory (what sockets and
    UCX take), the tensor itself for device memory (UCX reads its CUDA array interface)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _blocks_view(tensor: torch.Tensor) -> np.ndarray:
    """[layers * 2, num_blocks, block_bytes / itemsize] integer view of a CPU cache (or gathered blocks)."""
    return tensor.view(_BITS[tensor.element_size()]).numpy().reshape(tensor.shape[0] * 2, tensor.shape[2], -1)


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks `block_ids` (in range) as one new tensor [layers, 2, n, *block]: how blocks that form no
    runs worth a segment each travel. On CPU the copy is numpy's (see copy_segment)."""
    if kv_cache.device.type != "cpu":
        return kv_cache.index_select(2, torch.as_tensor(block_ids, device=kv_cache.device))
    data = np.take(_blocks_view(kv_cache), np.asarray(block_ids, dtype=np.int64), axis=1)
    return torch.from_numpy(data).view(kv_cache.dtype).view(kv_cache.shape[0], 2, len(block_ids), *kv_cache.shape[3:])


def scatter_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` (as from gather_blocks) into blocks `block_ids` (in range, unique) of the cache."""
    if kv_cache.device.type != "cpu":
        index = torch.as_tensor(block_ids, device=kv_cache.device)
        kv_cache.index_copy_(2, index, data.to(kv_cache.device, non_blocking=True))
        return
    _blocks_view(kv_cache)[:, np.asarray(block_ids, dtype=np.int64)] = _blocks_view(data)


def copy_segment(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bits only. On CPU the copy is numpy's: single-threaded and free of OpenMP,
    whose worker threads otherwise spin after each torch op and starve the socket threads of the
    cores a transfer needs (measured: 10x slower transfers on 2 cores)."""
    if dst.device.type != "cpu":
        dst.copy_(src.view(dst.dtype).view(dst.shape), non_blocking=True)
        return
    bits = _BITS[dst.element_size()]
    np.copyto(dst.view(bits).numpy(), src.view(bits).numpy().reshape(dst.shape), casting="no")


class EmbeddingSource(Protocol):
    """What a server needs of an encoder cache: `get(mm_hash)` -> [num_tokens, hidden_size] or None.

    A dict (any Mapping) has it; so does the encoder's LRU cache.
    """

    def get(self, mm_hash: str) -> torch.Tensor | None: ...


class KVTransferServer(abc.ABC):
    """Serves the blocks a local engine exposes and the embeddings its encoder cache holds.

    `expose` / `withdraw` are called by the engine's loop (the owner of the blocks and their
    leases); the server only reads exposed blocks, never frees or writes any.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        kv_cache: torch.Tensor | None = None,
        model_id: str = "",
        encoder_cache: EmbeddingSource | None = None,
        layout: KVLayout | None = None,
    ):
        self.engine_id = engine_id
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, *block]
        self.layout = kv_layout(kv_cache, model_id, layout) if kv_cache is not None else None
        self.encoder_cache = encoder_cache
        self.stats = TransferStats()  # bytes served
        # request id -> the block ids exposed for it; only these may be read by peers.
        self._exposed: dict[str, frozenset[int]] = {}

    def expose(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Let peers fetch `block_ids` under `request_id` (until withdraw)."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.engine_id} has no KV cache to expose")
        block_index(block_ids, self.kv_cache.shape[2], f"expose {request_id}")
        self._exposed[request_id] = frozenset(block_ids)

    def withdraw(self, request_id: str) -> None:
        """Stop serving the request's blocks (released, aborted or lease expired)."""
        self._exposed.pop(request_id, None)

    async def wait_sent(self, request_id: str, timeout: float = 60.0) -> bool:
        """Wait until no send still reads the request's blocks: blocks go out straight from the
        cache, so the engine frees withdrawn blocks only after this. False if some send still held
        them after `timeout` (a peer that stopped reading)."""
        return True

    def check_exposed(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Refuse a fetch of blocks not exposed for the request (exposed ids were checked against the
        cache by `expose`)."""
        exposed = self._exposed.get(request_id)
        if exposed is None:
            raise BlocksNotFoundError(f"{self.engine_id} holds no blocks for request {request_id!r}")
        if not exposed.issuperset(block_ids):
            raise BlockRangeError(f"request {request_id!r}: asked for blocks not exposed for it")

    def embeddings(self, mm_hash: str) -> torch.Tensor:
        tensor = self.encoder_cache.get(mm_hash) if self.encoder_cache is not None else None
        if tensor is None:
            raise EmbeddingNotFoundError(f"{self.engine_id} has no embeddings for mm_hash {mm_hash!r}")
        return tensor

    @abc.abstractmethod
    async def start(self) -> str:
        """Start serving; return the address peers fetch from (what KVHandle.kv_addr carries)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class KVTransferClient(abc.ABC):
    """Pulls remote blocks into the local KV cache, and embeddings by mm_hash.

    `stats` counts bytes, seconds and failures of every fetch. A failed fetch leaves the local
    blocks it was writing undefined: the caller frees them (or prefills locally).
    """

    def __init__(self, engine_id: str, *, kv_cache: torch.Tensor | None = None, model_id: str = "",
                 layout: KVLayout | None = None):
        self.engine_id = engine_id
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, *block]
        self.layout = kv_layout(kv_cache, model_id, layout) if kv_cache is not None else None
        self.stats = TransferStats()

    def runs(self, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[tuple[Run, Run]]:
        """The (remote, local) run pairs of a fetch, local ids checked against this cache."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.engine_id} has no KV cache to fetch into")
        if len(remote_block_ids) != len(local_block_ids):
            raise BlockRangeError(f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local ones")
        block_index(local_block_ids, self.kv_cache.shape[2], "local", unique=True)
        return common_runs(list(map(int, remote_block_ids)), list(map(int, local_block_ids)))

    @abc.abstractmethod
    async def fetch_blocks(
        self,
        kv_addr: str,
        request_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> FetchResult:
        """Copy remote blocks `remote_block_ids` (exposed under `request_id`) into local
        `local_block_ids`, pairwise. Raises a TransferError subclass on any failure."""

    @abc.abstractmethod
    async def fetch_embeddings(self, encoder_addr: str, mm_hash: str, *, timeout: float | None = None) -> torch.Tensor:
        """The [num_tokens, hidden_size] embeddings the encoder at `encoder_addr` holds for `mm_hash`."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


BACKENDS = ("zmq", "ucx")


def create_server(backend: str, engine_id: str, **kwargs) -> KVTransferServer:
    """A transfer server of the named backend ("zmq" default, "ucx" needs the ucx extra)."""
    if backend == "zmq":
        from epdserve.transport.zmq_kv import ZmqKVServer
        return ZmqKVServer(engine_id, **kwargs)
    if backend == "ucx":
        from epdserve.transport.ucx_kv import UcxKVServer
        return UcxKVServer(engine_id, **kwargs)
    raise ValueError(f"unknown KV transfer backend {backend!r}; choose from {BACKENDS}")


def create_client(backend: str, engine_id: str, **kwargs) -> KVTransferClient:
    if backend == "zmq":
        from epdserve.transport.zmq_kv import ZmqKVClient
        return ZmqKVClient(engine_id, **kwargs)
    if backend == "ucx":
        from epdserve.transport.ucx_kv import UcxKVClient
        return UcxKVClient(engine_id, **kwargs)
    raise ValueError(f"unknown KV transfer backend {backend!r}; choose from {BACKENDS}")
