"""What the prefix cache - and each KV tier beyond it - gained and lost, as numbered batches a router can follow.

The block manager records each block hash it registers (`stored`) and each registered block whose
content it drops (`removed`: evicted for reuse, or the whole cache reset); an engine's own tiers (the
local offload tier: offload_connector.py) report theirs by name (`tier_changed`). What was recorded since
the last read is sealed into one batch with the next sequence number when a reader asks. A reader asks
for the batches after the last number it applied; when those are no longer kept (it fell more than
`max_batches` batches behind, or this engine restarted) it gets a snapshot instead: every hash the cache
and each tier hold now, as of the last number.

Cost: one list append per block registered or evicted, and a bounded deque of batches.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping, NamedTuple


class TierEvents(NamedTuple):
    """A tier's changes in a batch (or, in a snapshot, everything it holds as `stored`)."""

    tier: str  # "local": this engine's offload tier
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]


class KVEventBatch(NamedTuple):
    first_seq: int
    last_seq: int
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    snapshot: bool = False
    tiers: tuple[TierEvents, ...] = ()  # beyond the pool, by tier


class _Changes:
    """Stores and removals of one place, in order; a reader applies removals before stores, so a store that
    a later removal cancels is dropped here (a dict: ordered, O(1) removal)."""

    __slots__ = ("stored", "removed")

    def __init__(self) -> None:
        self.stored: dict[bytes, None] = {}
        self.removed: list[bytes] = []

    def store(self, block_hash: bytes) -> None:
        self.stored[block_hash] = None

    def remove(self, block_hash: bytes) -> None:
        self.stored.pop(block_hash, None)
        self.removed.append(block_hash)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


def _merge(batches: Iterable[tuple[tuple[bytes, ...], tuple[bytes, ...]]]) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """Consecutive (stored, removed) changes as one: a later removal cancels an earlier store."""
    stored: list[bytes] = []
    removed: list[bytes] = []
    for batch_stored, batch_removed in batches:
        later_removed = set(batch_removed)
        stored = [h for h in stored if h not in later_removed]
        removed.extend(batch_removed)
        stored.extend(batch_stored)
    return tuple(stored), tuple(removed)


class KVEventLog:
    def __init__(self, max_batches: int = 1024) -> None:
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._pool = _Changes()
        self._tiers: dict[str, _Changes] = {}
        self.last_seq = 0  # the number of the newest sealed batch; 0: none yet

    def stored(self, block_hash: bytes) -> None:
        self._pool.store(block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._pool.remove(block_hash)

    def tier_changed(self, tier: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Tier `tier` gained `stored` and lost `removed` (in that order: a block can be saved, then dropped)."""
        changes = self._tiers.setdefault(tier, _Changes())
        for block_hash in stored:
            changes.store(block_hash)
        for block_hash in removed:
            changes.remove(block_hash)

    def seal(self) -> None:
        """Close the open batch (nothing is numbered when nothing changed)."""
        if not self._pool and not any(self._tiers.values()):
            return
        self.last_seq += 1
        tiers = tuple(TierEvents(name, tuple(c.stored), tuple(c.removed)) for name, c in self._tiers.items() if c)
        self._batches.append(KVEventBatch(self.last_seq, self.last_seq, tuple(self._pool.stored),
                                          tuple(self._pool.removed), tiers=tiers))
        self._pool, self._tiers = _Changes(), {}

    def since(self, next_seq: int | None, held: Iterable[bytes],
              tiers_held: Mapping[str, Iterable[bytes]] | None = None) -> KVEventBatch:
        """Everything from batch `next_seq` on, merged into one batch in order; a snapshot of `held` (the
        cache's hashes now) and `tiers_held` (each tier's) when `next_seq` is None or no longer kept. Call
        after `seal`."""
        oldest = self._batches[0].first_seq if self._batches else self.last_seq + 1
        if next_seq is None or not oldest <= next_seq <= self.last_seq + 1:
            tiers = tuple(TierEvents(name, tuple(hashes), ()) for name, hashes in (tiers_held or {}).items())
            return KVEventBatch(0, self.last_seq, tuple(held), (), snapshot=True, tiers=tiers)
        batches = [b for b in self._batches if b.first_seq >= next_seq]
        stored, removed = _merge((b.stored, b.removed) for b in batches)
        names = dict.fromkeys(t.tier for b in batches for t in b.tiers)
        tiers = tuple(TierEvents(name, *_merge((t.stored, t.removed) for b in batches for t in b.tiers if t.tier == name))
                      for name in names)
        return KVEventBatch(next_seq, self.last_seq, stored, removed, tiers=tiers)
