"""`OffloadConnector`: the engine's local offload tier, behind the KV door (kv_connector.py).

Blocks the pool evicts - and, with `save_finished`, the full blocks of every request that finishes - are
saved to a bounded second tier of the same engine: an `OffloadFile` (a memory-mapped file, LRU by chained
block hash). On a prefix hit beyond the pool's own cache, the tier offers the blocks it holds; the request
waits in WAITING_FOR_KV while they are copied into the blocks reserved for it, then runs from there.

Saving costs the engine's thread one gather of the evicted blocks into a staging tensor, made during the
eviction (before anything reuses the blocks); a worker thread writes the staged blocks to the file. Staging
is bounded (`max_staged_bytes`): past it, evicted blocks are dropped, not saved (counted), so a slow disk
never holds up a step. Loads go to the same worker ahead of saves and verify each block's checksum before
copying it into the cache: a block whose bytes changed in the file fails its load, and the request
computes those tokens itself - slower, never wrong.

A restored block holds exactly the KV the pool held (the bytes are copied, not recomputed), so output with
restored blocks is the output without the tier.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import tempfile
import threading
import time
from bisect import bisect_left
from typing import Sequence

import torch

from epdserve.shared.engine.kv_connector import EvictedBlock, KVConnector, KVLoad, LoadResult
from epdserve.shared.engine.offload_file import OffloadFile, checksum
from epdserve.shared.engine.outputs import RESTORE_SECONDS_BUCKETS, KVTierStats
from epdserve.shared.engine.request import Request

logger = logging.getLogger(__name__)

_LOAD, _SAVE = 0, 1  # the worker's priorities: a waiting request first
_files = itertools.count()


def offload_path(folder: str | None) -> str:
    """A fresh file name for one engine's tier in `folder` (None: under the temp folder). Engines of one
    deployment may share the folder: each has a file of its own, removed once mapped."""
    folder = folder or os.path.join(tempfile.gettempdir(), "epdserve-kv")
    return os.path.join(folder, f"offload-{os.getpid()}-{next(_files)}.bin")


class OffloadConnector(KVConnector):
    """See the module docstring. Owns its worker thread, the staging budget and the tier's counters; the
    file owns its slots and index."""

    name = "local"
    caches_prefixes = True

    def __init__(self, kv_cache: torch.Tensor, block_size: int, file: OffloadFile, save_finished: bool = False,
                 max_staged_bytes: int = 256 << 20) -> None:
        self.kv_cache, self.block_size, self.file = kv_cache, block_size, file
        self.save_finished = save_finished
        self.max_staged_bytes = max(max_staged_bytes, file.block_bytes)
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()  # the counters below and the staging budget
        self._staged_bytes = 0
        self._hit_blocks = self._hit_tokens = self._restored_bytes = 0
        self._saved_blocks = self._saved_bytes = self._dropped = 0
        self._failed = self._corrupt = 0
        self._buckets = [0] * (len(RESTORE_SECONDS_BUCKETS) + 1)
        self._restore_seconds = 0.0
        self._thread = threading.Thread(target=self._work, name="epdserve-kv-offload", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, kv_cache: torch.Tensor, block_size: int, num_bytes: int, folder: str | None = None,
               save_finished: bool = False) -> OffloadConnector:
        """A tier of `num_bytes` (whole blocks) for `kv_cache`, in a file of its own in `folder` (None: the
        temp folder's)."""
        block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        num_slots = num_bytes // block_bytes
        if num_slots <= 0:
            raise ValueError(f"kv offloading size {num_bytes} bytes holds no block of {block_bytes} bytes")
        file = OffloadFile(offload_path(folder), num_slots, block_shape, kv_cache.dtype, unlink=True)
        logger.info("KV offloading tier: %d blocks (%.2f GiB), mapped from %s (removed from the folder once "
                    "mapped)", num_slots, num_slots * block_bytes / (1 << 30), file.path)
        return cls(kv_cache, block_size, file, save_finished)

    # -- the engine's side (its thread) -------------------------------------------------------------
    def num_loadable_tokens(self, request: Request, num_local_tokens: int) -> int:
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # it needs the logits of every prompt position
        bs, tokens = self.block_size, request.all_token_ids
        start = num_local_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # its last token is computed
        if end <= start:
            return 0
        n = self.file.num_hits(request.block_hashes[start:end], [tokens[i * bs:(i + 1) * bs] for i in range(start, end)])
        return n * bs

    def start_load(self, request: Request, load: KVLoad) -> None:
        hashes = request.block_hashes[load.first_block:load.first_block + len(load.block_ids)]
        pinned = self.file.pin(hashes)
        if pinned is None:  # pushed out of the tier since it was offered (by saves of this very admission)
            with self._lock:
                self._failed += 1
            self.finish(LoadResult(load.request_id, False, "tier_evicted"))
            return
        self._jobs.put((_LOAD, next(self._seq), lambda: self._load(load, hashes, pinned, time.perf_counter())))

    def blocks_evicted(self, blocks: Sequence[EvictedBlock]) -> None:
        self._stage(blocks)

    def request_finished(self, request: Request) -> bool:
        if self.save_finished:
            bs = self.block_size
            num_full = min(request.num_computed_tokens // bs, len(request.block_hashes), len(request.block_ids))
            tokens = request.all_token_ids
            self._stage([EvictedBlock(request.block_hashes[i], request.block_ids[i], tuple(tokens[i * bs:(i + 1) * bs]))
                         for i in range(num_full)])
        return False  # copied now: nothing to keep

    def _stage(self, blocks: Sequence[EvictedBlock]) -> None:
        """Copy the blocks this tier lacks into a staging tensor now, for the worker to write."""
        wanted = [b for b in blocks if self.file.reserve(b.block_hash, b.token_ids) is not None]
        if not wanted:
            return
        num_bytes = len(wanted) * self.file.block_bytes
        with self._lock:
            full = self._staged_bytes + num_bytes > self.max_staged_bytes
            if full:
                self._dropped += len(wanted)
            else:
                self._staged_bytes += num_bytes
        if full:
            for block in wanted:
                self.file.unreserve(block.block_hash)
            return
        ids = torch.tensor([b.block_id for b in wanted], device=self.kv_cache.device)
        staging = self.kv_cache.index_select(2, ids)
        hashes = [b.block_hash for b in wanted]
        self._jobs.put((_SAVE, next(self._seq), lambda: self._save(hashes, staging, num_bytes)))

    def stats(self) -> KVTierStats:
        with self._lock:
            return KVTierStats(self.file.num_blocks, self.file.num_slots, self._hit_blocks, self._hit_tokens,
                               self._restored_bytes, self._saved_blocks, self._saved_bytes, self._dropped,
                               self._failed, self._corrupt, tuple(self._buckets), self._restore_seconds)

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        return self.file.take_changes()

    def hashes(self) -> list[bytes]:
        return self.file.hashes()

    def shutdown(self) -> None:
        """Let the worker finish the jobs queued (loads first), then close the file."""
        self._jobs.put((_SAVE + 1, next(self._seq), None))
        self._thread.join(timeout=10)
        self.file.close()

    # -- the worker thread --------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job's failure is its own; the tier goes on
                logger.exception("KV offloading job failed")

    def _save(self, hashes: list[bytes], staging: torch.Tensor, num_bytes: int) -> None:
        try:
            staging = staging.to("cpu")
            for j, block_hash in enumerate(hashes):
                self.file.write(block_hash, staging[:, :, j].contiguous())
        except BaseException:
            for block_hash in hashes:  # those not written yet
                self.file.unreserve(block_hash)
            raise
        finally:
            with self._lock:
                self._staged_bytes -= num_bytes
        with self._lock:
            self._saved_blocks += len(hashes)
            self._saved_bytes += num_bytes

    def _load(self, load: KVLoad, hashes: list[bytes], pinned: list[tuple[int, int]], started: float) -> None:
        ok, corrupt = False, []
        try:
            slots = [self.file.slot(slot) for slot, _ in pinned]
            corrupt = [h for h, data, (_, digest) in zip(hashes, slots, pinned) if checksum(data) != digest]
            if corrupt:
                logger.warning("request %s: %d KV blocks in the offloading tier do not match their checksum; "
                               "recomputing them", load.request_id, len(corrupt))
            else:
                for block_id, data in zip(load.block_ids, slots):
                    self.kv_cache[:, :, block_id].copy_(data)
                ok = True
        finally:
            self.file.unpin(hashes, [slot for slot, _ in pinned], corrupt)
            seconds = time.perf_counter() - started
            with self._lock:
                if ok:
                    self._hit_blocks += len(hashes)
                    self._hit_tokens += len(hashes) * self.block_size
                    self._restored_bytes += len(hashes) * self.file.block_bytes
                    self._buckets[bisect_left(RESTORE_SECONDS_BUCKETS, seconds)] += 1
                    self._restore_seconds += seconds
                else:
                    self._failed += 1
                    self._corrupt += len(corrupt)
            self.finish(LoadResult(load.request_id, ok, "" if ok else "tier_checksum"))

