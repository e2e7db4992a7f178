"""`epdserve serve kvstore`: a KV store every engine of a deployment shares, holding blocks by chained hash.

Engines put the blocks their pools evict and those of the requests they finish (`KVStorePut`), and get the
leading blocks of a prompt they lack (`KVStoreGet`); they learn what the store holds from its KV events
(`KVEventsRequest`, numbered batches as an engine's own: shared/engine/kv_events.py), so that deciding to
load costs them no round trip. Blocks are kept per KV layout (model, dtype, block shape) by their chained
hash - equal hashes mean equal prefixes (shared/block_hash.py) - with their token ids and the checksum they
were put with, which the store checks on arrival (a corrupted block is refused) and a getter checks again
once the bytes have landed.

Memory is bounded (`capacity_bytes`), least recently used blocks go first - to disk when the store has
one (`disk_bytes` per KV layout, in a memory-mapped file of `disk_path`, checksummed like an engine's
offload tier: shared/engine/offload_file.py), else away. A get is answered from memory, then from disk.
Token ids never leave the store: a get shows the token ids it expects, and only blocks holding exactly
those are sent (a peer learns nothing it did not already hold). A block is never replaced: a put of other
token ids under a hash the store holds is refused (the rest of the put is kept) and counted
(`epdserve:kv_store_conflicting_blocks`), so a peer cannot plant KV under a held prompt's hash. The store
is a cache: losing it (a crash, a restart, a full memory) costs engines recomputation, never a wrong token.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

from epdserve.shared.engine import KVEventLog, OffloadFile
from epdserve.shared.config import ServiceConfig
from epdserve.transport.kv.checksum import checksum
from epdserve.transport.channel.protocol import (Ack, Error, ErrorCode, Handshake, Health, KVEvents, KVEventsRequest,
                                                 KVLayout, KVStoreBlocks, KVStoreGet, KVStorePut, Message, Role,
                                                 Status)

disable_created_metrics()  # no `_created` series beside the counters, as every other service (and vLLM)
logger = logging.getLogger(__name__)
HASH_BYTES = 16


class _Block(NamedTuple):
    token_ids: tuple[int, ...]
    checksum: int
    data: torch.Tensor  # [num_layers, 2, num_kv_heads, block_size, head_size]


class KVStoreMetrics:
    def __init__(self, engine_id: str, rejected_frames: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": "kvstore", "engine_id": engine_id}

        def counter(name: str, doc: str):
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.blocks = Gauge("epdserve:kv_store_blocks", "KV blocks the store holds.", list(labels),
                            registry=self.registry).labels(**labels)
        self.bytes = Gauge("epdserve:kv_store_bytes", "Bytes of KV the store holds.", list(labels),
                           registry=self.registry).labels(**labels)
        self.put_blocks = counter("epdserve:kv_store_put_blocks", "KV blocks put (new or not).")
        self.corrupt_puts = counter("epdserve:kv_store_corrupt_blocks", "Put blocks refused: checksum mismatch.")
        self.conflicting_puts = counter("epdserve:kv_store_conflicting_blocks",
                                        "Put blocks refused: the store holds other token ids under their hash.")
        self.mismatched_gets = counter("epdserve:kv_store_mismatched_get_blocks",
                                       "Blocks asked for with token ids other than those the store holds: not sent.")
        self.get_blocks = counter("epdserve:kv_store_get_blocks", "KV blocks asked for.")
        self.hit_blocks = counter("epdserve:kv_store_hit_blocks", "KV blocks asked for and sent.")
        self.evicted_blocks = counter("epdserve:kv_store_evicted_blocks", "KV blocks dropped for room (LRU).")
        rejected = Gauge("epdserve:rejected_frames", "Control frames dropped as malformed, oversized or unknown.",
                         list(labels), registry=self.registry).labels(**labels)
        rejected.set_function(rejected_frames)


class KVStoreWorker:
    """Sole owner of the store's blocks (on the service's event loop: no lock) and its event log."""

    role = Role.KVSTORE
    data_addr = ""
    busy = False  # it holds no streams: a drain has nothing to wait for

    def __init__(self, config: ServiceConfig, capacity_bytes: int, rejected_frames: Callable[[], int],
                 disk_bytes: int = 0, disk_path: str | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the KV store's size must be positive, got {capacity_bytes} bytes")
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.blocks: OrderedDict[tuple[KVLayout, bytes], _Block] = OrderedDict()  # least recently used first
        self.disk_bytes, self.disk_path = disk_bytes, disk_path
        self.disks: dict[KVLayout, OffloadFile] = {}  # blocks memory let go, per layout (with a disk)
        self.events = KVEventLog()
        self.metrics = KVStoreMetrics(config.engine_id, rejected_frames)

    def status(self, health: Health) -> Status:
        return Status(self.config.engine_id, Role.KVSTORE, health, 0, len(self.blocks), 0, 0)

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        try:
            if isinstance(message, KVStorePut):
                return self.put(message)
            if isinstance(message, KVStoreGet):
                return self.get(message)
        except ValueError as exc:
            return bad_request(str(exc))
        if isinstance(message, KVEventsRequest):
            self.events.seal()
            held = dict.fromkeys(h for _, h in self.blocks)
            for disk in self.disks.values():
                held.update(dict.fromkeys(disk.hashes()))
            batch = self.events.since(message.next_seq, held)
            return KVEvents(self.config.engine_id, 0, batch.first_seq, batch.last_seq, b"".join(batch.stored),
                            b"".join(batch.removed), batch.snapshot)
        return bad_request(f"a kvstore service does not take {type(message).__name__}")

    def put(self, request: KVStorePut) -> Message:
        hashes = _split(request.block_hashes)
        n = len(hashes)
        layout = request.layout
        block_shape = (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_size)
        tensor = request.blocks[0] if len(request.blocks) == 1 else None
        if tensor is None or tuple(tensor.shape) != (n, *block_shape) or len(request.checksums) != n or \
                len(request.token_ids) != n * layout.block_size or str(tensor.dtype).removeprefix("torch.") != layout.dtype:
            return bad_request(f"a put of {n} blocks must carry one [{n}, {', '.join(map(str, block_shape))}] "
                                     f"{layout.dtype} tensor, {n} checksums and {n * layout.block_size} token ids")
        self.metrics.put_blocks.inc(n)
        bs = layout.block_size
        refused = 0
        for i, block_hash in enumerate(hashes):
            key = (layout, block_hash)
            token_ids = tuple(request.token_ids[i * bs:(i + 1) * bs])
            held = self._held_tokens(layout, block_hash)
            if held is not None:
                if held != token_ids:
                    refused += 1
                elif key in self.blocks:
                    self.blocks.move_to_end(key)
                continue
            data = tensor[i].clone()  # not a view of the received frame: the frame goes
            if checksum(data) != request.checksums[i]:
                self.metrics.corrupt_puts.inc()
                logger.warning("a put block from %s does not match its checksum: refused", layout.model_id)
                continue
            self.blocks[key] = _Block(token_ids, request.checksums[i], data)
            self.num_bytes += data.nbytes
            self.events.stored(block_hash)
        self._evict()
        if refused:
            self.metrics.conflicting_puts.inc(refused)
            logger.warning("a put of %d blocks of %s under hashes held with other token ids: refused", refused,
                           layout.model_id)
            return bad_request(f"{refused} of the {n} blocks put are held under their hash with other token ids")
        return Ack("")

    def _held_tokens(self, layout: KVLayout, block_hash: bytes) -> tuple[int, ...] | None:
        block = self.blocks.get((layout, block_hash))
        if block is not None:
            return block.token_ids
        disk = self.disks.get(layout)
        return disk.token_ids(block_hash) if disk is not None else None

    def _evict(self) -> None:
        while self.num_bytes > self.capacity_bytes and self.blocks:
            (layout, block_hash), block = self.blocks.popitem(last=False)
            self.num_bytes -= block.data.nbytes
            self.metrics.evicted_blocks.inc()
            disk = self._disk(layout, block.data)
            if disk is None:
                self.events.removed(block_hash)
                continue
            slot = disk.reserve(block_hash, block.token_ids)
            if slot is not None:
                disk.write(block_hash, block.data)
            _, dropped = disk.take_changes()
            for gone in dropped:  # the disk's own LRU: gone from the store unless memory has it again
                if (layout, gone) not in self.blocks:
                    self.events.removed(gone)
            if slot is None and not disk.holds(block_hash):
                self.events.removed(block_hash)
        self.metrics.blocks.set(len(self.blocks) + sum(d.num_blocks for d in self.disks.values()))
        self.metrics.bytes.set(self.num_bytes)

    def _disk(self, layout: KVLayout, block: torch.Tensor) -> OffloadFile | None:
        """The disk tier of `layout`'s blocks, made on first use; None without a disk."""
        if not self.disk_bytes:
            return None
        disk = self.disks.get(layout)
        if disk is None:
            num_slots = self.disk_bytes // block.nbytes
            if num_slots <= 0:
                return None
            folder = self.disk_path or os.path.join(tempfile.gettempdir(), "epdserve-kv")
            path = os.path.join(folder, f"kvstore-{os.getpid()}-{len(self.disks)}.bin")
            disk = self.disks[layout] = OffloadFile(path, num_slots, tuple(block.shape), block.dtype, unlink=True)
            logger.info("KV store: %d blocks of %s on disk (%s)", num_slots, layout.model_id, path)
        return disk

    def get(self, request: KVStoreGet) -> KVStoreBlocks:
        found: list[tuple[bytes, _Block]] = []
        hashes = _split(request.block_hashes)
        bs = request.layout.block_size
        if len(request.token_ids) != len(hashes) * bs:
            raise ValueError(f"a get of {len(hashes)} blocks must show their {len(hashes) * bs} token ids")
        self.metrics.get_blocks.inc(len(hashes))
        disk = self.disks.get(request.layout)
        for i, block_hash in enumerate(hashes):
            block = self.blocks.get((request.layout, block_hash))
            if block is not None:
                self.blocks.move_to_end((request.layout, block_hash))
            elif disk is not None and (stored := disk.read(block_hash)) is not None:
                token_ids, data, digest = stored
                block = _Block(token_ids, digest, data)
            else:
                if disk is not None:
                    for gone in disk.take_changes()[1]:  # a corrupt block it just dropped
                        self.events.removed(gone)
                break
            if block.token_ids != tuple(request.token_ids[i * bs:(i + 1) * bs]):
                self.metrics.mismatched_gets.inc()
                break  # the getter has not shown this block's prefix: nothing of it, nor of what follows
            found.append((block_hash, block))
        self.metrics.hit_blocks.inc(len(found))
        if not found:
            return KVStoreBlocks(b"", (), ())
        return KVStoreBlocks(b"".join(h for h, _ in found), tuple(b.checksum for _, b in found),
                             (torch.stack([b.data for _, b in found]),))

    async def close(self) -> None:
        self.blocks.clear()
        for disk in self.disks.values():
            disk.close()


def bad_request(message: str) -> Error:
    return Error(ErrorCode.BAD_REQUEST, message)


def _split(block_hashes: bytes) -> list[bytes]:
    if len(block_hashes) % HASH_BYTES:
        raise ValueError(f"block hashes are {HASH_BYTES} bytes each, got {len(block_hashes)} bytes")
    return [block_hashes[i:i + HASH_BYTES] for i in range(0, len(block_hashes), HASH_BYTES)]


async def build_kvstore_worker(config: ServiceConfig, rejected_frames: Callable[[], int]) -> KVStoreWorker:
    logger.info("KV store %s: up to %.2f GiB of blocks in memory, %.2f GiB per model on disk", config.engine_id,
                config.kv_store_bytes / (1 << 30), config.kv_store_disk_bytes / (1 << 30))
    return KVStoreWorker(config, config.kv_store_bytes, rejected_frames, config.kv_store_disk_bytes,
                         config.kv_store_path)
