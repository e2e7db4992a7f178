"""The KV block pool: allocation, reference counts and the prefix cache.

Prefix caching is a chained hash over *full* blocks: a block's hash covers its parent's hash, its token
ids and its extra keys (multimodal item hashes overlapping it; the request's `cache_salt` and LoRA
adapter on the first block), so equal hashes mean equal prefixes. A hit is also verified against the
block's stored token ids.
Free blocks wait in one LRU queue (an OrderedDict: O(1) removal from the middle when a cached block is
hit again); a cached block keeps its content until it is popped for reuse, which is the eviction. Each
registration and eviction is logged (`events`) for routers that follow what this cache holds, and the
blocks one allocation evicts are handed to `on_evict` before it returns - before anything writes them -
so a tier can copy them out (kv_connector.py).

Parallel sampling forks a sequence: the child takes a reference on every block of its parent's table
(`fork`). Full blocks are never written again, so sharing them is free; a shared *partial* last block
is copied on write - the first sequence to write into it gets a fresh block with the same content (the
copy is listed for the model runner, which makes it before the step's forward pass).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from epdserve.shared.block_hash import extend_block_hashes
from epdserve.shared.engine.kv_connector import EvictedBlock
from epdserve.shared.engine.kv_events import KVEventLog
from epdserve.shared.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full, registered block of some prefix; None otherwise.
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Sole owner of the blocks, the free queue and the hash map; writes `request.block_ids`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_key: bytes | None = None) -> None:
        """`hash_key`: the deployment's block-hash key (shared/block_hash.py), None: unkeyed."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_key = hash_key
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Least recently used first; never-filled and hashless blocks go to the front.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        # Blocks handed out fresh since the last `take_new_block_ids`: the model runner zeroes them, so
        # the unwritten tail of a request's last block never holds another request's leftovers.
        self.new_block_ids: list[int] = []
        # (source, destination) block copies for copy-on-write since the last `take_block_copies`.
        self.block_copies: list[tuple[int, int]] = []
        # request_id -> how many of its full blocks are registered in `cached_blocks` already.
        self._num_registered: dict[str, int] = {}
        # Registered and evicted hashes, for routers that follow what this cache holds.
        self.events = KVEventLog()
        # Told of the prefix-cache blocks each allocation evicts, while their content is still there.
        self.on_evict: Callable[[list[EvictedBlock]], None] | None = None
        self._evicted: list[EvictedBlock] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.mm_placeholders,
                            request.cache_salt, request.lora_key, self.hash_key)

    def get_computed_blocks(self, request: Request, max_tokens: int | None = None) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's first `max_tokens` tokens, in whole blocks.

        By default never its last token: that token must be computed for its logits. A request whose
        prompt KV comes from another engine needs no logits and may hit every full block. A request that
        wants its prompt's logprobs needs the logits of every prompt position: it hits nothing (as in vLLM).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        bs, tokens = self.block_size, request.all_token_ids
        max_tokens = request.num_tokens - 1 if max_tokens is None else max_tokens
        hits: list[KVBlock] = []
        for i in range(max_tokens // bs):
            block = self.cached_blocks.get(request.block_hashes[i])
            if block is None or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        return hits, len(hits) * bs

    # -- allocation ---------------------------------------------------------------------------------
    def _num_new_blocks(self, request: Request, num_new_tokens: int, num_computed_blocks: int) -> int:
        num_computed = request.num_computed_tokens or num_computed_blocks * self.block_size
        num_new = self.num_blocks_for(num_computed + num_new_tokens) - len(request.block_ids) - num_computed_blocks
        return num_new + (self._shared_partial_block(request) is not None)

    def _shared_partial_block(self, request: Request) -> int | None:
        """Index in the request's table of the block its next token goes into, if another sequence holds
        it too (a fork's partial last block): that block must be copied before it is written."""
        index = request.num_computed_tokens // self.block_size
        if request.num_computed_tokens % self.block_size == 0 or index >= len(request.block_ids):
            return None
        return index if self.blocks[request.block_ids[index]].ref_cnt > 1 else None

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        # Hit blocks that sit in the free queue leave it when touched, so they count against it too.
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        needed = self._num_new_blocks(request, num_new_tokens, len(computed_blocks))
        return needed + num_reclaimed <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> None:
        """Give `request` blocks for `num_new_tokens` more tokens, after its `computed_blocks` prefix hits."""
        assert self.can_allocate(request, num_new_tokens, computed_blocks)
        num_new = self._num_new_blocks(request, num_new_tokens, len(computed_blocks))
        for block in computed_blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1
            request.block_ids.append(block.block_id)
        if computed_blocks:
            self._num_registered[request.request_id] = len(computed_blocks)
        shared = self._shared_partial_block(request)
        if shared is not None:
            source, copy = self.blocks[request.block_ids[shared]], self._pop_free()
            source.ref_cnt -= 1  # still > 0: another sequence holds it
            request.block_ids[shared] = copy.block_id
            self.block_copies.append((source.block_id, copy.block_id))
            num_new -= 1
        # Which blocks are reused is the LRU queue's choice; their order in the table is ours, and
        # ascending ids make them contiguous in the cache wherever the queue hands out a freed run
        # (freed tables join it reversed), so a KV transfer moves them as a few runs, not block by block.
        fresh = sorted(self._pop_free().block_id for _ in range(max(num_new, 0)))
        request.block_ids.extend(fresh)
        self.new_block_ids.extend(fresh)
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            if self.on_evict is not None:
                self.on_evict(evicted)

    def _pop_free(self) -> KVBlock:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict its cached content
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                self.events.removed(block.block_hash)
                self._evicted.append(EvictedBlock(block.block_hash, block.block_id, block.token_ids))
            block.block_hash, block.token_ids = None, ()
        block.ref_cnt = 1
        return block

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks, by reference: its KV so far is the parent's."""
        assert not child.block_ids, f"request {child.request_id} already has blocks"
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_cnt += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        if parent.request_id in self._num_registered:
            self._num_registered[child.request_id] = self._num_registered[parent.request_id]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def skip_zeroing(self, block_ids: Sequence[int]) -> None:
        """These fresh blocks will be overwritten whole (by a KV transfer): zeroing them would race it."""
        skip = set(block_ids)
        self.new_block_ids = [b for b in self.new_block_ids if b not in skip]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # Computed and known: a step that verified draft tokens has computed positions whose tokens the
        # request is still being given one by one.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(start, num_full):
            block_hash = request.block_hashes[i]
            if block_hash in self.cached_blocks:
                continue  # another request computed the same block first; ours stays private
            block = self.blocks[request.block_ids[i]]
            block.block_hash, block.token_ids = block_hash, tuple(tokens[i * bs:(i + 1) * bs])
            self.cached_blocks[block_hash] = block
            self.events.stored(block_hash)
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (allocated for draft tokens that were
        rejected): they hold nothing of it, and join the front of the free queue."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt == 0 and block.block_hash is None, f"block {block_id} is not the request's alone"
            self.free_queue[block_id] = block
            self.free_queue.move_to_end(block_id, last=False)
        del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Drop the request's references. Cached blocks join the LRU tail, last block first, so a prefix's
        tail is evicted before its head; blocks without content join the front, to be reused first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)
