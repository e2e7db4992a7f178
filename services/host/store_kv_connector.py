"""`StoreKVConnector`: the engine's KV door (kv_connector.py) to a shared KV store (`epdserve serve kvstore`).

What it saves: the blocks the pool evicts, and the full blocks of every request that finishes - so that a
prefix computed on one engine reaches every other through the store. Either is copied out of the cache on
the engine's thread during the call (one gather into a staging tensor), then put to the store from the
service's event loop; at most `max_staged_bytes` wait to be put, past that blocks are dropped (counted).

What it loads: it follows the store's KV events (polled every `poll_interval`), so it knows, without a
round trip, which block hashes the store holds; on a prefix hit beyond the pool (and beyond the local
tier, which is asked first) it offers those blocks, and the request waits in WAITING_FOR_KV while they are
got, checked (count, token ids, XXH3 checksums of the bytes that landed) and copied into its blocks.

A store that does not answer (killed, restarting, partitioned) costs a request at most one `timeout`:
the load fails, the request computes its prompt, and the connector offers nothing for `retry_after`
seconds and forgets what the store held until its events answer again. Puts to it are dropped meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from bisect import bisect_left
from typing import Sequence

import torch

from epdserve.shared.engine import (RESTORE_SECONDS_BUCKETS, EvictedBlock, KVConnector, KVLoad, KVTierStats,
                                    LoadResult, Request)
from epdserve.transport.channel.common import ChannelError, ErrorReply
from epdserve.transport.kv.checksum import checksum
from epdserve.transport.channel.protocol import (Ack, ErrorCode, KVEvents, KVEventsRequest, KVLayout, KVStoreBlocks,
                                                 KVStoreGet, KVStorePut)
from epdserve.transport.channel.request_client import RequestClient

logger = logging.getLogger(__name__)
HASH_BYTES = 16
_FAILURES = (ChannelError, ErrorReply, TimeoutError, OSError)
MAX_PUT_BYTES = 32 << 20  # one put message's blocks, well under a tensor frame's limit


class StoreKVConnector(KVConnector):
    """See the module docstring. Owns its client to the store, its view of what the store holds and its tasks
    on the service's event loop (`close` ends them). A tier: its counters are the engine's stats' "store"
    tier (`stats`); it publishes no KV events of its own - what the store holds, routers follow from the
    store's events."""

    name = "store"
    caches_prefixes = True

    def __init__(self, address: str, kv_cache: torch.Tensor, layout: KVLayout, loop: asyncio.AbstractEventLoop,
                 client_kwargs: dict, timeout: float = 2.0, poll_interval: float = 0.5, retry_after: float = 5.0,
                 max_staged_bytes: int = 256 << 20) -> None:
        self.address, self.kv_cache, self.layout, self.loop = address, kv_cache, layout, loop
        self.block_size = layout.block_size
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.timeout, self.poll_interval, self.retry_after = timeout, poll_interval, retry_after
        self.max_staged_bytes = max_staged_bytes
        self.client = RequestClient(address, **{**client_kwargs, "timeout": timeout})
        # The store's block hashes, as its events said (replaced whole, read by the engine's thread).
        self._held: set[bytes] = set()
        self._next_seq: int | None = None
        self._down_until = 0.0  # offers nothing before this (monotonic): the store did not answer
        self._lock = threading.Lock()  # the counters and the staging budget
        self._staged_bytes = 0
        self._hit_blocks = self._restored_bytes = self._saved_blocks = self._saved_bytes = 0
        self._dropped = self._failed = self._corrupt = 0
        self._buckets = [0] * (len(RESTORE_SECONDS_BUCKETS) + 1)
        self._restore_seconds = 0.0
        self._tasks: set[asyncio.Task] = set()
        self._poller = loop.create_task(self._follow())

    # -- the engine's side (its thread) -------------------------------------------------------------
    def num_loadable_tokens(self, request: Request, num_local_tokens: int) -> int:
        if time.monotonic() < self._down_until or request.sampling_params.prompt_logprobs is not None:
            return 0
        held, bs = self._held, self.block_size
        start = num_local_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        n = 0
        while start + n < end and request.block_hashes[start + n] in held:
            n += 1
        return n * bs

    def start_load(self, request: Request, load: KVLoad) -> None:
        bs, tokens = self.block_size, request.all_token_ids
        first = load.first_block
        hashes = request.block_hashes[first:first + len(load.block_ids)]
        expected = tuple(tokens[first * bs:(first + len(hashes)) * bs])
        self.loop.call_soon_threadsafe(self._spawn, self._load(load, hashes, expected, time.perf_counter()))

    def blocks_evicted(self, blocks: Sequence[EvictedBlock]) -> None:
        self._stage(blocks)

    def request_finished(self, request: Request) -> bool:
        bs, tokens = self.block_size, request.all_token_ids
        num_full = min(request.num_computed_tokens // bs, len(request.block_hashes), len(request.block_ids))
        self._stage([EvictedBlock(request.block_hashes[i], request.block_ids[i], tuple(tokens[i * bs:(i + 1) * bs]))
                     for i in range(num_full)])
        return False  # copied now: nothing to keep

    def _stage(self, blocks: Sequence[EvictedBlock]) -> None:
        if time.monotonic() < self._down_until:
            return
        wanted = [b for b in blocks if b.block_hash not in self._held]
        if not wanted:
            return
        num_bytes = len(wanted) * self.block_bytes
        with self._lock:
            if self._staged_bytes + num_bytes > self.max_staged_bytes:
                self._dropped += len(wanted)
                return
            self._staged_bytes += num_bytes
        ids = torch.tensor([b.block_id for b in wanted], device=self.kv_cache.device)
        staging = self.kv_cache.index_select(2, ids)
        self.loop.call_soon_threadsafe(self._spawn, self._put(wanted, staging, num_bytes))

    def stats(self) -> KVTierStats:
        with self._lock:
            return KVTierStats(len(self._held), 0, self._hit_blocks, self._hit_blocks * self.block_size,
                               self._restored_bytes, self._saved_blocks, self._saved_bytes, self._dropped,
                               self._failed, self._corrupt, tuple(self._buckets), self._restore_seconds)

    # -- the event loop -----------------------------------------------------------------------------
    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _unreachable(self, what: str, exc: BaseException) -> None:
        if time.monotonic() >= self._down_until:
            logger.warning("KV store %s: %s failed (%s: %s); not using it for %.0fs", self.address, what,
                           type(exc).__name__, exc, self.retry_after)
        self._down_until = time.monotonic() + self.retry_after
        self._held, self._next_seq = set(), None

    async def _put(self, blocks: list[EvictedBlock], staging: torch.Tensor, num_bytes: int) -> None:
        try:
            data = staging.to("cpu").permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, *block]
            per_message = max(MAX_PUT_BYTES // self.block_bytes, 1)
            for start in range(0, len(blocks), per_message):
                part, chunk = blocks[start:start + per_message], data[start:start + per_message]
                message = KVStorePut(self.layout, b"".join(b.block_hash for b in part),
                                     tuple(t for b in part for t in b.token_ids),
                                     tuple(checksum(chunk[i]) for i in range(len(part))), (chunk,))
                try:
                    await self.client.request(message, timeout=self.timeout, expect=Ack)
                except ErrorReply as exc:
                    if exc.error.code is not ErrorCode.BAD_REQUEST:
                        raise
                    # It kept the others and refused blocks it holds under other tokens: the store is up.
                    logger.warning("the KV store refused part of a put: %s", exc.error.message)
                    with self._lock:
                        self._dropped += len(part)
                    continue
                self._held.update(b.block_hash for b in part)  # its events will say so too
                with self._lock:
                    self._saved_blocks += len(part)
                    self._saved_bytes += len(part) * self.block_bytes
        except _FAILURES as exc:
            with self._lock:
                self._dropped += len(blocks)
            self._unreachable("a put", exc)
        finally:
            with self._lock:
                self._staged_bytes -= num_bytes

    async def _load(self, load: KVLoad, hashes: list[bytes], expected: tuple[int, ...], started: float) -> None:
        ok, reason = False, "store_unreachable"
        try:
            reply = await self.client.request(KVStoreGet(self.layout, b"".join(hashes), expected), timeout=self.timeout,
                                              expect=KVStoreBlocks)
            ok, reason = self._copy_in(load, hashes, expected, reply)
        except _FAILURES as exc:
            self._unreachable("a get", exc)
        seconds = time.perf_counter() - started
        with self._lock:
            if ok:
                self._hit_blocks += len(hashes)
                self._restored_bytes += len(hashes) * self.block_bytes
                self._buckets[bisect_left(RESTORE_SECONDS_BUCKETS, seconds)] += 1
                self._restore_seconds += seconds
            else:
                self._failed += 1
        self.finish(LoadResult(load.request_id, ok, "" if ok else reason))

    def _copy_in(self, load: KVLoad, hashes: list[bytes], expected: tuple[int, ...],
                 reply: KVStoreBlocks) -> tuple[bool, str]:
        """Check what the store sent and copy it into the load's blocks; (ok, why not)."""
        # The store sends only blocks whose token ids are the ones this get showed it (`expected`).
        if reply.block_hashes != b"".join(hashes) or len(reply.blocks) != 1:
            for block_hash in hashes[len(reply.block_hashes) // HASH_BYTES:]:
                self._held.discard(block_hash)  # gone from the store since its last events
            return False, "store_missing"
        data = reply.blocks[0]
        if tuple(data.shape[1:]) != tuple(self.kv_cache[:, :, 0].shape) or data.dtype != self.kv_cache.dtype:
            return False, "store_layout"
        bad = [i for i in range(len(hashes)) if checksum(data[i]) != reply.checksums[i]]
        if bad:
            with self._lock:
                self._corrupt += len(bad)
            logger.warning("request %s: %d KV blocks from the store landed corrupted; recomputing them",
                           load.request_id, len(bad))
            return False, "integrity"
        for block_id, block in zip(load.block_ids, data):
            self.kv_cache[:, :, block_id].copy_(block)
        return True, ""

    async def _follow(self) -> None:
        """Poll the store's KV events: what it holds, as it changes (a snapshot when out of step)."""
        while True:
            try:
                events = await self.client.request(KVEventsRequest(self._next_seq), timeout=self.timeout,
                                                   expect=KVEvents)
                self._apply(events)
            except _FAILURES as exc:
                self._unreachable("following its events", exc)
            except asyncio.CancelledError:
                raise
            await asyncio.sleep(self.poll_interval)

    def _apply(self, events: KVEvents) -> None:
        stored = [events.stored[i:i + HASH_BYTES] for i in range(0, len(events.stored), HASH_BYTES)]
        removed = [events.removed[i:i + HASH_BYTES] for i in range(0, len(events.removed), HASH_BYTES)]
        if events.snapshot:
            self._held = set(stored)
        elif events.first_seq != self._next_seq:  # the store restarted, or we fell behind: start over
            self._next_seq = None
            return
        else:
            held = set(self._held)
            held.difference_update(removed)
            held.update(stored)
            self._held = held
        self._next_seq = events.last_seq + 1

    async def close(self) -> None:
        self._poller.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self._poller, *self._tasks, return_exceptions=True)
        await self.client.close()
