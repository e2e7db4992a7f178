"""The local offload tier's storage: KV blocks in a memory-mapped file, found by their chained block hash.

The file is cut into fixed slots of one block each (every layer's K and V, `[num_layers, 2, num_kv_heads,
block_size, head_size]`, contiguous). An index maps a block hash to its slot, its token ids (a hit is checked
against them, as the prefix cache checks its own) and the XXH3 checksum of its bytes as written; the index
is least recently used first, and a full file reuses the slot of its oldest block. The file is scratch: it
is truncated at start, and the index lives in memory only. Page cache does the rest: recently written
blocks are read back at memory speed, older ones from the disk.

Two threads touch it: the engine's (reserving slots for blocks it evicts, finding and pinning hits) and the
tier's worker (writing and reading slot bytes). The index is guarded by one lock, held only for dictionary
work; slot bytes are copied outside it. A slot is written only while its entry is not yet `ready` (nobody
may read it) and read only while pinned (nobody may reuse it), so no slot is read and written at once.

A slot whose bytes no longer match their checksum (a corrupted file, a bad disk) is never used: the load
that finds it fails - its request computes those tokens itself - and the entry is dropped.
"""
from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from math import prod
from typing import Sequence

import torch
import xxhash


def checksum(data: torch.Tensor) -> int:
    """XXH3-64 of a contiguous CPU tensor's bytes (the hash the KV transfer checks its segments with)."""
    return xxhash.xxh3_64_intdigest(data.reshape(-1).view(torch.uint8).numpy())


class _Entry:
    __slots__ = ("slot", "token_ids", "checksum", "ready", "readers")

    def __init__(self, slot: int, token_ids: tuple[int, ...]) -> None:
        self.slot = slot
        self.token_ids = token_ids
        self.checksum = 0
        self.ready = False  # its bytes are written and checksummed: it may be offered
        self.readers = 0  # loads reading its slot now: it may not be reused


class OffloadFile:
    """Sole owner of the tier file, its slots and its index; see the module docstring."""

    def __init__(self, path: str, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype,
                 unlink: bool = False) -> None:
        """`unlink`: remove the file's name once it is mapped (its space returns when the process ends)."""
        if num_slots <= 0:
            raise ValueError(f"the KV offloading tier must hold at least one block, got {num_slots} slots")
        self.path = path
        self.num_slots = num_slots
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w+b") as f:
            f.truncate(num_slots * self.block_bytes)
            self._map = mmap.mmap(f.fileno(), num_slots * self.block_bytes)
        if unlink:
            os.unlink(path)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._orphans: dict[int, int] = {}  # slot of a dropped entry -> loads still reading it
        self._num_ready = 0
        # Hashes this tier gained and lost since the last `take_changes` (for the engine's KV events).
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []

    def slot(self, slot: int) -> torch.Tensor:
        """One slot's bytes, as a block of KV (a view into the mapped file)."""
        start = slot * self.block_bytes
        return self._bytes[start:start + self.block_bytes].view(self.dtype).view(self.block_shape)

    @property
    def num_blocks(self) -> int:
        """Blocks it can offer now (read without the lock: a snapshot for stats)."""
        return self._num_ready

    def holds(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._entries

    def token_ids(self, block_hash: bytes) -> tuple[int, ...] | None:
        """The token ids a block was kept with; None if this tier holds no block under that hash."""
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry.token_ids if entry is not None else None

    def hashes(self) -> list[bytes]:
        """Every block hash this tier can offer now."""
        with self._lock:
            return [h for h, e in self._entries.items() if e.ready]

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since the last call."""
        with self._lock:
            changes = self._stored, self._removed
            self._stored, self._removed = [], []
            return changes

    # -- saving (engine thread reserves, worker writes) ---------------------------------------------
    def reserve(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """A slot for a block this tier does not hold yet, reusing the least recently used block's when the
        file is full; None if it holds it already (then it counts as used now) or every slot is busy."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None:
                self._entries.move_to_end(block_hash)
                return None
            if not self._free:
                victim = next((h for h, e in self._entries.items() if e.ready and e.readers == 0), None)
                if victim is None:
                    return None
                self._free.append(self._drop(victim))
            slot = self._free.pop()
            self._entries[block_hash] = _Entry(slot, token_ids)
            return slot

    def write(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Write a reserved block's KV (contiguous, on the CPU) and make it available (worker thread)."""
        with self._lock:
            entry = self._entries[block_hash]
        self.slot(entry.slot).copy_(block)
        digest = checksum(block)
        with self._lock:
            entry.checksum, entry.ready = digest, True
            self._num_ready += 1
            self._stored.append(block_hash)

    def unreserve(self, block_hash: bytes) -> None:
        """Give back a reserved slot whose block will not be written (a written one stays)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None and not entry.ready:
                del self._entries[block_hash]
                self._free.append(entry.slot)

    # -- loading (engine thread finds and pins, worker reads) -----------------------------------------
    def num_hits(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]]) -> int:
        """How many of the blocks, from the first, this tier holds with those very tokens; they count as
        used now (the most recent), so the saves that follow do not push them out first."""
        n = 0
        with self._lock:
            for block_hash, tokens in zip(block_hashes, token_ids):
                entry = self._entries.get(block_hash)
                if entry is None or not entry.ready or entry.token_ids != tuple(tokens):
                    break
                self._entries.move_to_end(block_hash)
                n += 1
        return n

    def pin(self, block_hashes: Sequence[bytes]) -> list[tuple[int, int]] | None:
        """(slot, checksum) of each block, held for reading until `unpin`; None (nothing pinned) if one is
        no longer here."""
        with self._lock:
            entries = [self._entries.get(h) for h in block_hashes]
            if any(e is None or not e.ready for e in entries):
                return None
            for e in entries:
                e.readers += 1
            return [(e.slot, e.checksum) for e in entries]

    def unpin(self, block_hashes: Sequence[bytes], slots: Sequence[int], corrupt: Sequence[bytes] = ()) -> None:
        """End a read of these blocks; `corrupt` ones (bytes that do not match their checksum) are dropped."""
        with self._lock:
            for block_hash, slot in zip(block_hashes, slots):
                entry = self._entries.get(block_hash)
                if entry is not None and entry.slot == slot:
                    entry.readers -= 1
                elif slot in self._orphans:  # dropped while this load read it: free once nobody does
                    self._orphans[slot] -= 1
                    if self._orphans[slot] == 0:
                        del self._orphans[slot]
                        self._free.append(slot)
            for block_hash in corrupt:
                if block_hash in self._entries:
                    slot = self._drop(block_hash)
                    if slot not in self._orphans:  # else the last of its readers frees it
                        self._free.append(slot)

    def read(self, block_hash: bytes) -> tuple[tuple[int, ...], torch.Tensor, int] | None:
        """(token ids, a copy of the block, its checksum) of a block held, its bytes checked against the
        checksum (a corrupt one is dropped); None if it is not here or not intact. Counts as a use."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or not entry.ready:
                return None
            self._entries.move_to_end(block_hash)
            entry.readers += 1
            slot, digest, token_ids = entry.slot, entry.checksum, entry.token_ids
        data = self.slot(slot).clone()
        intact = checksum(data) == digest
        self.unpin([block_hash], [slot], () if intact else [block_hash])
        return (token_ids, data, digest) if intact else None

    def _drop(self, block_hash: bytes) -> int:
        """Remove an entry (lock held); its slot, which the caller frees (or keeps while it is read)."""
        entry = self._entries.pop(block_hash)
        if entry.ready:
            self._num_ready -= 1
            self._removed.append(block_hash)
        if entry.readers:
            self._orphans[entry.slot] = entry.readers
        return entry.slot

    def close(self) -> None:
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the process's end unmaps it
            pass
