"""The engine's one door for what a request's prompt needs from elsewhere: KV blocks a peer computed, and the
encoder outputs of its images.

A `KVConnector` has two halves, as vLLM's KV connectors do:

- Its scheduler half runs on the engine's thread, between steps. When the scheduler is about to admit a
  request, it asks each connector how many of the request's leading tokens, beyond those its own prefix
  cache holds, the connector can supply (`num_loadable_tokens`), and whether it can supply encoder outputs
  the request lacks for tokens it must compute (`can_load_embeddings`). If one can, the scheduler
  allocates the blocks, parks the request as WAITING_FOR_KV (no seat, no compute, never preempted: its
  blocks are being written) and hands the connector a `KVLoad`.
- Its worker half moves the bytes, on whatever thread or loop it likes, and reports the end of each load
  with the `LoadResult` callback it was bound to (any thread). A load that worked makes the request
  runnable with those tokens computed; one that failed leaves it to compute them itself (recompute),
  which is always correct - only slower. The step never waits on a transfer.

A request marks itself for connectors with `kv_transfer_params` (opaque to the engine: a peer's KV handle,
say). Each request's connectors are asked at most once for its KV; encoder outputs are asked for whenever a
(re)computation needs ones it lacks, after a failed KV load or a preemption. `request_ended` tells the
connector a request is gone (finished, aborted, failed), once its blocks are no longer being written.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    import torch

    from epdserve.shared.engine.request import Request


class KVLoad(NamedTuple):
    """What the scheduler set aside for one load."""

    request_id: str
    block_ids: list[int]  # local blocks to fill, in order (empty: encoder outputs only)
    first_block: int  # index of block_ids[0] in the request's block table
    num_tokens: int  # the request's computed tokens once the blocks are filled
    mm_hashes: tuple[str, ...] = ()  # encoder outputs to supply


class LoadResult(NamedTuple):
    """How a load ended. `reason` names a failure (a span suffix, e.g. "blocks_not_found")."""

    request_id: str
    ok: bool
    reason: str = ""
    mm_embeddings: dict[str, "torch.Tensor"] = {}  # mm_hash -> [num_tokens, hidden_size]


class KVConnector(abc.ABC):
    """One way KV (or encoder output) reaches the engine; see the module docstring."""

    def bind(self, finish: Callable[[LoadResult], None]) -> None:
        """`finish(result)` ends a load; the engine binds it before the first request arrives."""
        self.finish = finish

    def num_loadable_tokens(self, request: Request, num_local_tokens: int) -> int:
        """How many of the request's leading tokens beyond `num_local_tokens` this connector can supply (0:
        none), up to the end of its prompt."""
        return 0

    def can_load_embeddings(self, request: Request, mm_hashes: tuple[str, ...]) -> bool:
        """Whether this connector can supply the encoder outputs `mm_hashes` of the request."""
        return False

    @abc.abstractmethod
    def start_load(self, request: Request, load: KVLoad) -> None:
        """Begin filling `load` without blocking the engine's thread; report with `finish`."""

    def request_ended(self, request: Request) -> None:
        """The request is gone and no load of it is in flight: forget it."""
