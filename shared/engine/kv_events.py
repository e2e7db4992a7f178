"""What the prefix cache gained and lost, as numbered batches a router can follow.

The block manager records each block hash it registers (`stored`) and each registered block whose
content it drops (`removed`: evicted for reuse, or the whole cache reset); what was recorded since the
last read is sealed into one batch with the next sequence number when a reader asks. A reader asks for
the batches after the last number it applied; when those are no longer kept (it fell more than
`max_batches` batches behind, or this engine restarted) it gets a snapshot instead: every hash the cache
holds now, as of the last number.

Cost: one list append per block registered or evicted, and a bounded deque of batches.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, NamedTuple


class KVEventBatch(NamedTuple):
    first_seq: int
    last_seq: int
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    snapshot: bool = False


class KVEventLog:
    def __init__(self, max_batches: int = 1024) -> None:
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        # A reader applies a batch's removals before its stores, so a store that a later removal in the
        # same batch cancels is dropped here (a dict: ordered, O(1) removal).
        self._stored: dict[bytes, None] = {}
        self._removed: list[bytes] = []
        self.last_seq = 0  # the number of the newest sealed batch; 0: none yet

    def stored(self, block_hash: bytes) -> None:
        self._stored[block_hash] = None

    def removed(self, block_hash: bytes) -> None:
        self._stored.pop(block_hash, None)
        self._removed.append(block_hash)

    def seal(self) -> None:
        """Close the open batch (nothing is numbered when nothing changed)."""
        if not self._stored and not self._removed:
            return
        self.last_seq += 1
        self._batches.append(KVEventBatch(self.last_seq, self.last_seq, tuple(self._stored), tuple(self._removed)))
        self._stored, self._removed = {}, []

    def since(self, next_seq: int | None, held: Iterable[bytes]) -> KVEventBatch:
        """Everything from batch `next_seq` on, merged into one batch in order; a snapshot of `held` (the
        cache's hashes now) when `next_seq` is None or no longer kept. Call after `seal`."""
        oldest = self._batches[0].first_seq if self._batches else self.last_seq + 1
        if next_seq is None or not oldest <= next_seq <= self.last_seq + 1:
            return KVEventBatch(0, self.last_seq, tuple(held), (), snapshot=True)
        stored: list[bytes] = []
        removed: list[bytes] = []
        for batch in self._batches:
            if batch.first_seq >= next_seq:
                # Likewise across the merged batches: a later removal cancels an earlier store.
                later_removed = set(batch.removed)
                stored = [h for h in stored if h not in later_removed]
                removed.extend(batch.removed)
                stored.extend(batch.stored)
        return KVEventBatch(next_seq, self.last_seq, tuple(stored), tuple(removed))
