"""The scheduler's side of the KV door (kv_connector.py): which waiting request a connector can feed, the
blocks set aside for it, and the loads in flight.

A request in `loading` is WAITING_FOR_KV: it holds its blocks (being written) but no seat, computes nothing
and is never preempted. Aborting it does not free them: they go back only when its load ends.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from epdserve.shared.engine.block_manager import BlockManager, KVBlock
from epdserve.shared.engine.kv_connector import EvictedBlock, KVConnector, KVLoad
from epdserve.shared.engine.request import Request


class Admission(enum.Enum):
    NONE = "none"  # no connector feeds it: the scheduler computes it
    STARTED = "started"  # a load began: the request leaves the waiting queue
    NO_ROOM = "no_room"  # a connector would feed it, but its blocks do not fit now
    UNSERVABLE = "unservable"  # it must compute positions whose encoder outputs nobody can supply


class Loading(NamedTuple):
    request: Request
    load: KVLoad
    connector: KVConnector


class KVLoads:
    """Owns the connectors (the engine's one list of them, `LLMEngine.connectors`) and the loads in flight; the
    scheduler owns the requests themselves."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.connectors: list[KVConnector] = []
        self.loading: dict[str, Loading] = {}
        block_manager.on_evict = self._evicted

    @property
    def has_tier(self) -> bool:
        """Whether a connector is a KV tier (`caches_prefixes`): requests' prefixes are looked up there too."""
        return any(connector.caches_prefixes for connector in self.connectors)

    @property
    def num_waiting(self) -> int:
        """Requests held back while a connector loads their KV or encoder outputs (aborted ones excluded)."""
        return sum(not loading.request.is_finished for loading in self.loading.values())

    def _evicted(self, blocks: list[EvictedBlock]) -> None:
        for connector in self.connectors:
            connector.blocks_evicted(blocks)

    def try_start(self, request: Request, computed_blocks: list[KVBlock], num_cached: int) -> Admission:
        """Start a load for `request` (waiting, its prefix hits found) if a connector can feed it: the one
        that offers the most tokens (ties: the first added)."""
        if self.connectors and not request.kv_load_started:
            best, best_tokens = None, 0
            for connector in self.connectors:
                num_tokens = min(connector.num_loadable_tokens(request, num_cached),
                                 request.num_prompt_tokens - num_cached)
                if num_tokens > best_tokens:
                    best, best_tokens = connector, num_tokens
            # Positions left to compute after the load need their encoder outputs first: those are loaded
            # now, and the KV once the request is back at the queue's head with them.
            if best is not None and not request.missing_embeddings(num_cached + best_tokens):
                return self._start_kv(request, best, computed_blocks, num_cached, best_tokens)
        missing = request.missing_embeddings(num_cached)
        if not missing:
            return Admission.NONE
        connector = next((c for c in self.connectors if c.can_load_embeddings(request, missing)), None)
        if connector is None:
            return Admission.UNSERVABLE
        self._start(request, connector, KVLoad(request.request_id, [], 0, request.num_computed_tokens, missing))
        return Admission.STARTED

    def _start_kv(self, request: Request, connector: KVConnector, computed_blocks: list[KVBlock], num_cached: int,
                  num_tokens: int) -> Admission:
        bm = self.block_manager
        if not bm.can_allocate(request, num_tokens, computed_blocks):
            return Admission.NO_ROOM
        bm.allocate(request, num_tokens, computed_blocks)
        fill = request.block_ids[len(computed_blocks):]
        bm.skip_zeroing(fill)  # overwritten whole by the load; zeroing them at the next step would race it
        request.num_computed_tokens = num_cached
        request.kv_load_started = True
        self._start(request, connector, KVLoad(request.request_id, fill, len(computed_blocks), num_cached + num_tokens))
        return Admission.STARTED

    def _start(self, request: Request, connector: KVConnector, load: KVLoad) -> None:
        self.loading[request.request_id] = Loading(request, load, connector)
        connector.start_load(request, load)

    def take(self, request_id: str) -> Loading | None:
        """The load of `request_id`, which has ended (None: unknown, or ended already)."""
        return self.loading.pop(request_id, None)

    def keeps(self, request: Request) -> bool:
        """Whether a connector keeps the blocks of `request`, which just finished (the one that does releases
        them). Every connector is told - a tier copies the blocks out then - even once one keeps them."""
        return any([connector.request_finished(request) for connector in self.connectors])

    def ended(self, request: Request) -> None:
        """`request` is gone: the connectors that may know it forget it."""
        if request.kv_transfer_params is not None or request.mm_placeholders:
            for connector in self.connectors:
                connector.request_ended(request)
