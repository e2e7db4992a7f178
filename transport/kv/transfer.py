"""KV transfer: how engines hand each other paged KV-cache blocks and encoder embeddings - what every server,
client and data path shares (errors, layouts, runs, the cache's segments as bytes).

An engine's KV cache is one tensor
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]   (dim 1: K, V)
and a block is `kv_cache[:, :, block_id]`. A prefill engine runs a KVTransferServer (server.py),
exposes each request's blocks while it holds them under a lease, and withdraws them on release; a decode
engine's KVTransferClient (client.py) pulls given remote block ids into given local block ids. An
encoder's server exposes its encoder cache (mm_hash -> [num_tokens, hidden_size]) the same way. The states
a request's blocks pass through on the way are named in states.py.

Before any block moves the two sides compare KVLayout (model id, dtype, block size, layers, KV heads,
head size) and the transport in the connection handshake. Block ids and sizes that come from the wire are
checked against the local cache on both sides: a server serves only blocks it exposed for that request,
under the generation it gave that exposure (a handle to blocks released since is refused, never read), and a
client writes only blocks it named, with exactly the shape its own cache has. Every segment and embedding
tensor carries the checksum its sender took of the bytes sent, which the receiver compares with the bytes
that landed (checksum.py).

Blocks move as runs: a client pairs remote and local block ids into runs consecutive on both sides
(`common_runs`; the block manager allocates so that a request's blocks usually are), and each run
moves as one segment per layer and K/V, straight from the server's cache memory into the client's -
no gather or scatter buffer on either side. Blocks in runs too short for that (a segment per block,
layer and K/V costs more per byte than copying it) are gathered into one segment instead.

How the bytes travel is a data path's business (base.py: what each implements), each in a package of its own
that knows no other: plain TCP block connections (transport/block_stream/) and ZMQ frames
(transport/zmq_frames/) make the "zmq" transport, UCX tagged messages (transport/ucx/) the "ucx" one; control
goes over a typed ZMQ channel (transport/channel/) for all. `transports.create_server` / `create_client`
assemble a transport's paths; both ends of a transfer must use the same transport, which the handshake checks.

Importing this module registers tensor frames with the codec (channel/tensor_frames.py), so every process that
moves KV blocks or embeddings can send and receive tensors.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

import numpy as np
import torch

from epdserve.transport.channel.protocol import KVLayout
from epdserve.transport.channel.tensor_frames import dtype_name


class TransferError(Exception):
    """A transfer failed; the local blocks it was writing hold no usable data."""


class IncompatiblePeerError(TransferError):
    """The peer's protocol version or KV layout differs from ours (or it refused our keys)."""


class BlockRangeError(TransferError, ValueError):
    """Block ids outside the cache, not exposed for the request, duplicated, or mismatched in count."""


class BlocksNotFoundError(TransferError):
    """The server exposes no blocks for the request (released, or its lease expired): RELEASED (states.py)."""


class StaleHandleError(BlocksNotFoundError):
    """The server exposes the request's blocks under another generation than the handle's: the blocks the
    handle named were released since (and may hold another request's KV by now): the handle is STALE."""


class IntegrityError(TransferError):
    """Bytes landed other than the peer sent: their checksums differ (see checksum.py). Corrupted in flight,
    or read by the sender while being overwritten; what landed is unusable."""


class EmbeddingNotFoundError(TransferError):
    """The encoder cache holds no embeddings for the mm_hash (never encoded, or evicted)."""


class PeerUnreachableError(TransferError):
    """No connection to the peer: refused (its process is gone, and what it held with it), or not made within
    the client's connect timeout (its host down or cut off)."""


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
    num_retries: int = 0  # fetches made again because their connection dropped

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


def transport_mismatch(ours: str, theirs: str | None, us: str, them: str) -> str | None:
    """Why two ends cannot move data between them, or None: each must use the same transport."""
    if theirs is None or theirs == ours:
        return None
    return (f"{us} moves KV and embeddings over {ours}, {them} over {theirs}: start every encoder, "
            f"prefill and decode of a deployment with the same --kv-transport")


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
