"""KV-aware choices: send a request where its prompt is already cached, unless that instance is too busy.

Each candidate's cost is the work the request would make there, in blocks of the prompt:

    cost = (prompt blocks - leading blocks it holds) + load_weight * prompt blocks * requests it has

where a block held in the instance's local offload tier (not its pool) counts `tier_weight` of one held
in the pool (it is restored by a copy, not computed: prefix_index.py), and one only the shared KV store
holds `store_weight` (a transfer over the network), so a follow-up turn goes to the
decode (or prefill) that holds its conversation so far, and moves
elsewhere only when the queue there costs more than recomputing (or pulling) the prompt would; an
instance without room for the blocks it lacks is chosen last. `load_weight` says what one queued
request costs relative to the whole prompt (0: ignore load; large: least loaded first).

The decode that holds all but a few tokens of the prompt computes them itself: the proxy then skips
prefill and the transfer (`local_prefill_tokens`).
"""
from __future__ import annotations

import enum
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar


class RoutingPolicy(str, enum.Enum):
    KV = "kv"  # by cached prefix (the index of the engines' KV events) and load
    LOAD = "load"  # prefill by prefix affinity (a hash of the prompt's head), decode by free blocks and load


@dataclass(frozen=True)
class KVRoutingConfig:
    policy: RoutingPolicy = RoutingPolicy.KV
    load_weight: float = 0.25
    # A decode holding all but at most this many of the prompt's tokens prefills the rest itself.
    local_prefill_tokens: int = 256
    # What a block in an instance's offload tier is worth against one in its pool (1: as much; 0: nothing).
    tier_weight: float = 0.8
    # ... and a block in the shared KV store, which any instance gets over the network.
    store_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"the KV routing load weight must be >= 0, got {self.load_weight}")
        if not 0 <= self.tier_weight <= 1:
            raise ValueError(f"the KV routing tier weight must be in [0, 1], got {self.tier_weight}")
        if not 0 <= self.store_weight <= 1:
            raise ValueError(f"the KV routing store weight must be in [0, 1], got {self.store_weight}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")


class _Status(Protocol):
    num_free_blocks: int


class Candidate(Protocol):
    address: str
    load: int
    status: _Status | None


C = TypeVar("C", bound=Candidate)


def pick(candidates: Sequence[C], cached_blocks: dict[str, float], prompt_blocks: int, load_weight: float,
         key: bytes = b"", elsewhere: float = 0.0) -> tuple[C, float]:
    """The cheapest candidate and how many leading blocks it holds. `cached_blocks`: address -> blocks
    held (from the prefix index, tier and store blocks weighted; absent: `elsewhere`, the store's). Equal
    costs - above all a prompt nobody caches yet - go by rendezvous hashing of `key` (the prompt's head):
    distinct prompts spread, and requests that share a new prefix meet where its blocks will be, before any
    engine has reported them."""
    scale = load_weight * max(prompt_blocks, 1)
    lacking = prompt_blocks - elsewhere  # what a candidate absent from `cached_blocks` lacks
    held_by = cached_blocks.get
    # One pass that allocates no tuple per candidate (no call, nothing for the garbage collector): a fleet of
    # a thousand is scored in a fraction of a millisecond. The cost is compared as (no room, work).
    least_no_room, least_work = True, math.inf
    tied: list[C] = []
    for candidate in candidates:
        held = held_by(candidate.address)
        missing = lacking if held is None else prompt_blocks - held
        status = candidate.status
        no_room = (status.num_free_blocks if status is not None else 0) < missing
        work = missing + scale * candidate.load
        if no_room > least_no_room or (no_room == least_no_room and work > least_work):
            continue
        if no_room < least_no_room or work < least_work or not tied:
            least_no_room, least_work, tied = no_room, work, [candidate]
        else:
            tied.append(candidate)
    best = tied[0] if len(tied) == 1 else max(tied, key=lambda c: rendezvous(key, c.address))
    return best, cached_blocks.get(best.address, elsewhere)


def rendezvous(key: bytes, address: str) -> int:
    """The instance's score for `key` in rendezvous (highest random weight) hashing: the key's and the
    address's digests, each taken once (a decision may break a tie among hundreds of instances), mixed by
    splitmix64's finalizer so that each key orders the instances its own way. The same in every proxy."""
    z = _digest(key) ^ _digest(address.encode())
    z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 & _WORD
    z = (z ^ z >> 27) * 0x94D049BB133111EB & _WORD
    return z ^ z >> 31


_WORD = (1 << 64) - 1


@functools.lru_cache(maxsize=1 << 16)
def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
