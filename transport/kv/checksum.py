"""Checksums of the bytes a transfer moves: the one place that takes them, and the one that compares them.

A sender takes one checksum per segment (a run of KV blocks in one layer's K or V, a gathered block
buffer, an embedding tensor) over the exact bytes it sends, and sends the checksums with its reply; the
receiver takes them again over the bytes once they have landed (in its cache blocks, or the tensor it
returns) and refuses a fetch whose checksums differ with IntegrityError. That catches bytes changed in
flight and bytes a sender read while something overwrote them, which no layer below us would notice:
TCP's 16-bit checksum misses some multi-bit errors, shared memory and RDMA check nothing, and a block
read while it was being reused is sent intact.

The hash is XXH3 (64 bits, seed 0), over the buffer's memory itself (no copy): non-cryptographic and
fast enough to run on every transfer (benchmarks/results/transfer.md has its cost). It runs at memory
speed from memory and several times that from the CPU's caches, so the data paths hash bytes right after a
copy touched them, piece by piece (`copy_hashed`; the block connections' sockets). xxhash releases the GIL
while it hashes. Device memory is copied to the host first, which a GPU cache pays on every segment.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from epdserve.transport.kv.transfer import IntegrityError


def checksum(buffer) -> int:
    """The checksum of a flat buffer's bytes: a contiguous numpy array, bytes-like object or tensor."""
    if isinstance(buffer, torch.Tensor):  # as_bytes() of device memory, or any contiguous tensor
        flat = buffer.detach().reshape(-1).view(torch.uint8)
        buffer = (flat if flat.device.type == "cpu" else flat.cpu()).numpy()
    return xxhash.xxh3_64_intdigest(buffer)


def checksums(buffers: Sequence) -> tuple[int, ...]:
    return tuple(checksum(buffer) for buffer in buffers)


def running():
    """The checksum of a buffer taken piece by piece, as it is sent or received: `update(piece)` with its
    consecutive pieces, then `intdigest()` - equal to `checksum` of the whole."""
    return xxhash.xxh3_64()


# Bytes copied then hashed at a time by `copy_hashed`: hashed while the CPU's caches still hold them.
PIECE_BYTES = 256 << 10


def copy_hashed(dst: np.ndarray, src: np.ndarray) -> int:
    """dst[:] = src (flat uint8 arrays of one size), piece by piece, each hashed as soon as it is in `dst`: the
    checksum of `dst`'s bytes as they landed, for the price of hashing them from the CPU's caches."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copying {src.nbytes} bytes into {dst.nbytes}")
    digest = running()
    for start in range(0, dst.nbytes, PIECE_BYTES):
        piece = dst[start:start + PIECE_BYTES]
        np.copyto(piece, src[start:start + PIECE_BYTES], casting="no")
        digest.update(piece)
    return digest.intdigest()


def verify(sent: Sequence[int], landed: Sequence[int], what: str) -> None:
    """Compare the checksums a sender took (`sent`) with those of the bytes that landed; IntegrityError,
    naming `what` and the first segment that differs, unless every one matches."""
    if len(sent) != len(landed):
        raise IntegrityError(f"{what}: {len(sent)} checksums for {len(landed)} segments")
    for i, (theirs, ours) in enumerate(zip(sent, landed)):
        if theirs != ours:
            raise IntegrityError(f"{what}: segment {i} of {len(landed)} landed corrupted "
                                 f"(checksum {ours:016x}, sent as {theirs:016x})")
