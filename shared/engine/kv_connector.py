"""The engine's one door for KV that comes from elsewhere or goes elsewhere: KV blocks a peer computed, the
encoder outputs of a request's images, and the KV of finished requests that a peer (or another tier) reads.

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
- Saving: when a request finishes (stopped, or at its length), the scheduler asks the connectors whether
  one keeps its blocks (`request_finished`): a prefill's, for the decode that pulls them; a tier's, while
  it copies them. Kept blocks stay allocated - out of the pool, readable by the connector's worker half,
  never written - until the connector calls the `release` it was bound to (any thread). An aborted or
  failed request keeps nothing.
- Saving on eviction: when the pool reuses a free block that still holds a full, registered prefix block
  (the prefix cache's eviction), the block manager first tells the connectors which blocks go
  (`blocks_evicted`: hash, block id, tokens), on the engine's thread, before the step that reuses them
  writes anything. A connector that wants them must copy their KV out during that call (one gather into a
  staging tensor, which a worker thread then writes wherever it keeps them); reuse is never deferred, so an
  eviction costs the step one copy, never a wait on a tier.

A request marks itself for peers' connectors with `kv_transfer_params` (opaque to the engine: a peer's KV
handle, say); a tier's connector offers what it holds of any request's prefix, by block hash. Every
connector is asked; the one that offers the most tokens loads them (ties: the first added). Each request's
connectors are asked at most once for its KV; encoder outputs are asked for whenever a
(re)computation needs ones it lacks, after a failed KV load or a preemption. `request_ended` tells the
connector a request is gone (finished, aborted, failed), once its blocks are no longer being written.

The rest of the contract is what the engine and the services ask of every connector, through this class
only (as vLLM's KVConnectorBase_V1 carries its stats, events and shutdown); each has a default for a
connector with nothing to say:

- `expect(request_id, kv_transfer_params)`: a request with these params is about to be submitted (the
  engine's thread, just before the request is added): a connector that must hold something for it until
  its load (a peer's lease on the prompt's blocks) starts doing so.
- `stats()`: its counters as a KV tier (`KVTierStats`), which the engine's stats carry under its `name`
  (a service's metrics read them when scraped: any thread).
- `take_changes()` and `hashes()`: the block hashes it stored and removed since the last call, and all it
  holds now, which the engine's KV events carry under its `name`, for routers.
- `shutdown()`: stop its threads, when the engine closes (`LLMEngine.close`); `close()`: let go of what it
  runs on an event loop (tasks, connections), awaited on that loop (`AsyncLLM.close`).

The engine holds its connectors in one list, `LLMEngine.connectors`, and asks each in the order it was
added: its own tier first, then those the front door adds (a service's peers', then its shared store's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch

    from epdserve.shared.engine.outputs import KVTierStats
    from epdserve.shared.engine.request import Request


class KVLoad(NamedTuple):
    """What the scheduler set aside for one load."""

    request_id: str
    block_ids: list[int]  # local blocks to fill, in order (empty: encoder outputs only)
    first_block: int  # index of block_ids[0] in the request's block table
    num_tokens: int  # the request's computed tokens once the blocks are filled
    mm_hashes: tuple[str, ...] = ()  # encoder outputs to supply


class EvictedBlock(NamedTuple):
    """A full prefix-cache block about to be reused: its content is still in `block_id` during the call."""

    block_hash: bytes
    block_id: int
    token_ids: tuple[int, ...]


class LoadResult(NamedTuple):
    """How a load ended. `reason` names a failure (a span suffix, e.g. "blocks_not_found")."""

    request_id: str
    ok: bool
    reason: str = ""
    mm_embeddings: dict[str, "torch.Tensor"] = {}  # mm_hash -> [num_tokens, hidden_size]


class KVConnector:
    """One way KV (or encoder output) reaches the engine or leaves it; see the module docstring. Every method
    but `start_load` has a default that does nothing (or says nothing). The scheduler half and `expect` are
    called on the engine's thread; `stats` on any; `shutdown` and `close` once, as they say."""

    # A tier: it offers the KV of any request's prefix it holds, by block hash - what it brings counts as the
    # engine's external prefix-cache hits (prompt_stats.py) - rather than one request's KV a peer hands over.
    caches_prefixes = False
    # What the engine's stats (`kv_tiers`) and KV events (`TierEvents.tier`) call it: "local" (the engine's
    # offload tier), "store" (a shared KV store), "peer".
    name = ""

    def bind(self, finish: Callable[[LoadResult], None], release: Callable[[str], None]) -> None:
        """`finish(result)` ends a load, `release(request_id)` frees the blocks this connector kept; the
        engine binds them before the first request arrives."""
        self.finish, self.release = finish, release

    def num_loadable_tokens(self, request: Request, num_local_tokens: int) -> int:
        """How many of the request's leading tokens beyond `num_local_tokens` this connector can supply (0:
        none), up to the end of its prompt."""
        return 0

    def can_load_embeddings(self, request: Request, mm_hashes: tuple[str, ...]) -> bool:
        """Whether this connector can supply the encoder outputs `mm_hashes` of the request."""
        return False

    def start_load(self, request: Request, load: KVLoad) -> None:
        """Begin filling `load` without blocking the engine's thread; report with `finish`. Called only for
        what `num_loadable_tokens` or `can_load_embeddings` offered."""
        raise NotImplementedError

    def request_finished(self, request: Request) -> bool:
        """The request just finished with its KV in `request.block_ids`: True keeps those blocks (one
        sequence of a group at a time; a release names the group) until `release(request id)`."""
        return False

    def request_ended(self, request: Request) -> None:
        """The request is gone and no load of it is in flight: forget it."""

    def blocks_evicted(self, blocks: Sequence[EvictedBlock]) -> None:
        """These prefix-cache blocks are about to be reused: a connector that keeps evicted KV copies it
        now (their content is gone once this returns)."""

    # -- what else the engine and its front door ask -------------------------------------------------
    def expect(self, request_id: str, kv_transfer_params: object) -> None:
        """Request `request_id`, whose `kv_transfer_params` these are, is about to be added (the engine's
        thread, right before it is; `AsyncLLM.expect` queues the call ahead of the request's submit). A
        connector that must hold something for it until its load starts - a decode's hold on the prefill's
        blocks, renewing their lease and giving up past its timeout - starts doing so now. Not every request
        is announced: only those a service expects KV for."""

    def stats(self) -> KVTierStats | None:
        """Its counters as a KV tier, for the engine's stats (`EngineStats.kv_tiers[name]`, thence a
        service's metrics); None: it is no tier and has none. Any thread may call it."""
        return None

    def take_changes(self) -> tuple[Sequence[bytes], Sequence[bytes]] | None:
        """(block hashes it stored, removed) since the last call, for the engine's KV events (the engine's
        thread); None: it publishes no KV events (a peer's; the shared store, whose events routers follow
        from the store itself)."""
        return None

    def hashes(self) -> Sequence[bytes] | None:
        """Every block hash it holds now, for a snapshot of the engine's KV events; None as `take_changes`."""
        return None

    def shutdown(self) -> None:
        """Stop the threads it runs and free what they hold; called once, when the engine closes
        (`LLMEngine.close`), after the engine's loop stopped: no other call comes after it."""

    async def close(self) -> None:
        """Let go of what it runs on an event loop (tasks, connections): awaited once, on that loop, after the
        engine's loop stopped (`AsyncLLM.close` awaits every connector's, in order)."""


def tier_stats(connectors: Iterable[KVConnector]) -> dict[str, KVTierStats]:
    """The counters of those `connectors` that are KV tiers, by name (`EngineStats.kv_tiers`)."""
    return {connector.name: stats for connector in connectors if (stats := connector.stats()) is not None}
