"""Where every prefix lives: the KV blocks each engine instance reports it holds, indexed by block hash.

Engines report the blocks their prefix cache gains and loses as numbered events (`KVEvents`: chained
block hashes, see shared/engine/block_hash.py). The router applies them here and asks, for a prompt's
block hashes, how many leading blocks each instance holds. Event numbers make loss visible: an event
batch that does not start where the last one ended (lost, or the instance restarted and counts from 1
again) clears what the index knows of that instance and asks for a snapshot, which replaces it whole.

An engine with a local offload tier reports that tier's blocks too, in the same numbered batches; they
are kept in a second index of the same kind (`tier`), fed and resynced with the first. A shared KV store
reports its own (`store`, one holder every engine may load from). `match_weighted` counts an instance's
leading blocks in its pool, then those its tier holds beyond them at `tier_weight` (a tier block is
restored by a copy: cheaper than computing it, dearer than a pool hit), then those the store holds beyond
both at `store_weight` (a transfer over the network).

Memory is bounded: a block is keyed by the first 8 bytes of its hash (an int; a collision can only
make the router over-estimate a cached prefix, never corrupt a cache - the engine checks its own
hashes and token ids), and each instance may hold at most `max_blocks_per_instance` keys; past that its
oldest are forgotten, as the engine itself would evict them first.

A block's holders are one int: its one holder's slot (>= 0, most blocks past a shared head), or the
complement of a bit mask of slots (< 0, a block several hold). Two reasons: a prompt's leading blocks held
by hundreds of instances are intersected as machine words, not as sets of hundreds; and maps that hold
only ints are never walked by the garbage collector, whose full collections over millions of entries
would otherwise land inside routing decisions.
"""
from __future__ import annotations

import sys
from typing import Iterator, Sequence


STORE = "kvstore"  # the shared KV store's name in `PrefixIndex.store`


def _by_start(counts: dict[str, int]) -> dict[int, list[str]]:
    """Instances grouped by how many leading blocks they hold (few distinct counts: one lookup each)."""
    groups: dict[int, list[str]] = {}
    for name, n in counts.items():
        groups.setdefault(n, []).append(name)
    return groups


def block_key(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def _mask(held: int | None) -> int:
    """The bit mask of the slots a block's holders entry names (0: nobody)."""
    return 0 if held is None else 1 << held if held >= 0 else ~held


def _slots(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _Holdings:
    __slots__ = ("slot", "keys", "next_seq", "synced")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.keys: dict[int, None] = {}  # insertion order: oldest first
        self.next_seq = 1  # the number the next event batch must start at
        self.synced = False  # False until a snapshot (or events from 1) has been applied


class PrefixIndex:
    """Block key -> the instances holding it; instance -> its keys. One owner: the router."""

    def __init__(self, max_blocks_per_instance: int = 1 << 20, tiers: bool = True) -> None:
        self.max_blocks_per_instance = max_blocks_per_instance
        # What each instance's local offload tier holds (its numbering is the pool's: one batch says both).
        self.tier: PrefixIndex | None = PrefixIndex(max_blocks_per_instance, tiers=False) if tiers else None
        # What the shared KV store holds, as its one holder STORE.
        self.store: PrefixIndex | None = PrefixIndex(max_blocks_per_instance, tiers=False) if tiers else None
        # Block key -> its one holder's slot, or ~(mask of its holders' slots) (module docstring).
        self._holders: dict[int, int] = {}
        self._instances: dict[str, _Holdings] = {}
        self._names: dict[int, str] = {}
        self._free_slots: list[int] = []
        self.num_resyncs = 0
        self.block_size: int | None = None  # tokens per block, as the engines report it

    # -- events ---------------------------------------------------------------------------------------
    def apply(self, instance: str, first_seq: int, last_seq: int, stored: Sequence[bytes],
              removed: Sequence[bytes], snapshot: bool = False, tier_stored: Sequence[bytes] = (),
              tier_removed: Sequence[bytes] = ()) -> bool:
        """Apply events [first_seq, last_seq] of `instance` (a snapshot: all it holds, as of last_seq), of
        its pool and (`tier_*`) of its local offload tier.

        Returns False when they do not follow what was applied before: the instance's entry is then
        cleared and the caller must ask for a snapshot."""
        if self.tier is not None:
            self.tier.apply(instance, first_seq, last_seq, tier_stored, tier_removed, snapshot)
        holdings = self._instances.get(instance) or self._add(instance)
        # A new entry takes batches from 1 on: the instance's whole history.
        follows = first_seq == holdings.next_seq and (holdings.synced or first_seq == 1)
        if snapshot:
            self._clear(holdings)
        elif not follows:
            self.num_resyncs += 1
            self._clear(holdings)
            holdings.synced, holdings.next_seq = False, 0  # only a snapshot is taken now
            return False
        holdings.synced = True
        for h in removed:
            self._remove(holdings, block_key(h))
        for h in stored:
            self._store(holdings, block_key(h))
        holdings.next_seq = last_seq + 1
        return True

    def next_seq(self, instance: str) -> int | None:
        """The first event number the index wants from `instance`; None: a snapshot."""
        holdings = self._instances.get(instance)
        return holdings.next_seq if holdings is not None and holdings.synced else None

    def drop(self, instance: str) -> None:
        """Forget an instance (it died or left)."""
        if self.tier is not None:
            self.tier.drop(instance)
        holdings = self._instances.pop(instance, None)
        if holdings is not None:
            self._clear(holdings)
            del self._names[holdings.slot]
            self._free_slots.append(holdings.slot)

    # -- queries --------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Instance name -> how many of the leading `block_hashes` it holds (instances holding none
        are absent)."""
        return self.runs([block_key(h) for h in block_hashes], {})

    def runs(self, keys: Sequence[int], starts: dict[str, int]) -> dict[str, int]:
        """Instance name -> how many consecutive blocks of `keys` (block_key) it holds from position
        `starts[name]` on, from the first block for an instance `starts` does not name - in one walk over
        the keys (instances holding none there are absent)."""
        n = len(keys)
        joining: dict[int, int] = {0: 0}  # position -> the mask of the slots whose run starts there
        start_of: dict[int, int] = {}  # slot -> its start, where not 0
        named = 0
        for name, start in starts.items():
            holdings = self._instances.get(name)
            if holdings is not None:
                named |= 1 << holdings.slot
                if start < n:
                    joining[start] = joining.get(start, 0) | 1 << holdings.slot
                    start_of[holdings.slot] = start
        joining[0] |= ~named  # everyone else (a mask without end: the first block's holders bound it)
        positions = sorted(joining, reverse=True)
        holders, runs, active, i = self._holders, {}, 0, 0  # active: the slots whose run goes on
        while i < n:
            if not active:  # nothing to follow until the next start
                while positions and positions[-1] < i:
                    positions.pop()
                if not positions:
                    break
                i = positions[-1]
            held = holders.get(keys[i])
            held = 0 if held is None else 1 << held if held >= 0 else ~held
            still = active & held
            if still != active:
                for slot in _slots(active ^ still):  # a slot's run is set once, when it ends
                    runs[slot] = i - start_of.get(slot, 0)
            active = still | joining.get(i, 0) & held
            i += 1
        for slot in _slots(active):
            runs[slot] = n - start_of.get(slot, 0)
        return {self._names[slot]: run for slot, run in runs.items()}

    def match_weighted(self, block_hashes: Sequence[bytes], tier_weight: float,
                       store_weight: float = 0.0) -> tuple[dict[str, float], float]:
        """(instance name -> the leading `block_hashes` it holds in its pool, plus `tier_weight` times those
        its local tier holds right after them, plus `store_weight` times those the shared store holds after
        both - the engine restores exactly those: kv_connector.py; what an instance absent from the dict
        holds: the store's leading blocks at `store_weight`)."""
        keys = [block_key(h) for h in block_hashes]
        pool = self.runs(keys, {})
        reach: dict[str, int] = dict(pool)  # leading blocks in pool or tier
        held: dict[str, float] = {name: float(n) for name, n in pool.items()}
        if self.tier is not None and tier_weight > 0:
            # One walk: the tier's run after the pool's for an instance the pool holds some of, from the
            # first block for the others.
            for name, n in self.tier.runs(keys, pool).items():
                held[name] = held.get(name, 0.0) + tier_weight * n
                reach[name] = reach.get(name, 0) + n
        if self.store is None or store_weight <= 0:
            return held, 0.0
        for start, names in _by_start(reach).items():
            more = self.store.runs(keys, {STORE: start}).get(STORE, 0)
            for name in names:
                held[name] += store_weight * more
        return held, store_weight * self.store.runs(keys, {}).get(STORE, 0)

    def blocks_per_instance(self) -> dict[str, int]:
        return {name: len(holdings.keys) for name, holdings in self._instances.items()}

    def num_blocks(self, instance: str) -> int:
        holdings = self._instances.get(instance)
        return len(holdings.keys) if holdings else 0

    def memory_bytes(self) -> int:
        """An estimate of what the index takes (keys, maps and the masks of shared blocks)."""
        total = sys.getsizeof(self._holders)
        for key, held in self._holders.items():
            total += sys.getsizeof(key) + (sys.getsizeof(held) if held < 0 else 0)
        for holdings in self._instances.values():
            total += sys.getsizeof(holdings.keys)  # its int keys are the ones counted above
        return total + sum(part.memory_bytes() for part in (self.tier, self.store) if part is not None)

    # -- internals ------------------------------------------------------------------------------------
    def _add(self, instance: str) -> _Holdings:
        slot = self._free_slots.pop() if self._free_slots else len(self._names)
        holdings = self._instances[instance] = _Holdings(slot)
        self._names[slot] = instance
        return holdings

    def _store(self, holdings: _Holdings, key: int) -> None:
        if key in holdings.keys:
            del holdings.keys[key]  # stored again: now the newest
            holdings.keys[key] = None
            return
        holdings.keys[key] = None
        held = self._holders.get(key)
        self._holders[key] = holdings.slot if held is None else ~(_mask(held) | 1 << holdings.slot)
        if len(holdings.keys) > self.max_blocks_per_instance:
            self._remove(holdings, next(iter(holdings.keys)))

    def _remove(self, holdings: _Holdings, key: int) -> None:
        if key not in holdings.keys:
            return  # not held (its store event was lost, or it was forgotten for the bound)
        del holdings.keys[key]
        held = self._holders[key]
        if held >= 0:
            del self._holders[key]
            return
        rest = ~held & ~(1 << holdings.slot)
        self._holders[key] = rest.bit_length() - 1 if rest & (rest - 1) == 0 else ~rest  # one left: its slot

    def _clear(self, holdings: _Holdings) -> None:
        for key in list(holdings.keys):
            self._remove(holdings, key)
