"""KV-aware choices: send a request where its prompt is already cached, unless that instance is too busy.

Each candidate's cost is the work the request would make there, in blocks of the prompt:

    cost = (prompt blocks - leading blocks it holds) + load_weight * prompt blocks * requests it has

so a follow-up turn goes to the decode (or prefill) that holds its conversation so far, and moves
elsewhere only when the queue there costs more than recomputing (or pulling) the prompt would; an
instance without room for the blocks it lacks is chosen last. `load_weight` says what one queued
request costs relative to the whole prompt (0: ignore load; large: least loaded first).

The decode that holds all but a few tokens of the prompt computes them itself: the proxy then skips
prefill and the transfer (`local_prefill_tokens`).
"""
from __future__ import annotations

import enum
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

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"the KV routing load weight must be >= 0, got {self.load_weight}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")


class _Status(Protocol):
    num_free_blocks: int


class Candidate(Protocol):
    address: str
    load: int
    status: _Status | None


C = TypeVar("C", bound=Candidate)


def pick(candidates: Sequence[C], cached_blocks: dict[str, int], prompt_blocks: int,
         load_weight: float) -> tuple[C, int]:
    """The cheapest candidate and how many leading blocks it holds. `cached_blocks`: address -> blocks
    held (from the prefix index; absent: none)."""
    scale = load_weight * max(prompt_blocks, 1)

    def cost(candidate: C) -> tuple[bool, float]:
        missing = prompt_blocks - cached_blocks.get(candidate.address, 0)
        free = candidate.status.num_free_blocks if candidate.status is not None else 0
        return free < missing, missing + scale * candidate.load

    best = min(candidates, key=cost)
    return best, cached_blocks.get(best.address, 0)
