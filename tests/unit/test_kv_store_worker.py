"""The KV store's own rules: blocks by layout and chained hash, LRU within its size, corrupt puts refused,
the leading blocks of a get, and KV events a follower can apply; a block goes only to a getter showing its
token ids, and a put never replaces a block with other tokens."""
import asyncio
import subprocess
import sys

import torch

from epdserve.services.kvstore.worker import KVStoreWorker
from epdserve.shared.config import ServiceConfig
from epdserve.transport.kv.checksum import checksum
from epdserve.transport.channel.protocol import (Ack, Error, KVEvents, KVEventsRequest, KVLayout, KVStoreBlocks,
                                                 KVStoreGet, KVStorePut)

LAYOUT = KVLayout("m", "float32", 4, 2, 1, 8)
OTHER = KVLayout("m2", "float32", 4, 2, 1, 8)
BLOCK_BYTES = 2 * 2 * 1 * 4 * 8 * 4


def h(i: int) -> bytes:
    return bytes([i]) * 16


def put(worker, hashes, layout=LAYOUT, corrupt=()):
    blocks = torch.stack([torch.full((2, 2, 1, 4, 8), float(i)) for i in hashes])
    sums = [checksum(b) ^ (1 if i in corrupt else 0) for i, b in zip(hashes, blocks)]
    message = KVStorePut(layout, b"".join(h(i) for i in hashes), tuple(t for i in hashes for t in [i] * 4),
                         tuple(sums), (blocks,))
    return asyncio.run(worker.handle(message, None))


def get(worker, hashes, layout=LAYOUT, token_ids=None) -> KVStoreBlocks:
    token_ids = tuple(t for i in hashes for t in [i] * 4) if token_ids is None else token_ids
    return asyncio.run(worker.handle(KVStoreGet(layout, b"".join(h(i) for i in hashes), token_ids), None))


def test_blocks_by_layout_and_hash_least_recently_used_first():
    worker = KVStoreWorker(ServiceConfig("kvstore", "s"), 3 * BLOCK_BYTES, lambda: 0)
    assert isinstance(put(worker, [1, 2, 3]), Ack)
    got = get(worker, [1, 2, 9, 3])  # the leading ones held: 1, 2
    assert got.block_hashes == h(1) + h(2)
    assert torch.equal(got.blocks[0][1], torch.full((2, 2, 1, 4, 8), 2.0))
    assert [checksum(b) for b in got.blocks[0]] == list(got.checksums)
    assert get(worker, [1], OTHER).block_hashes == b""  # another model's blocks are another's
    put(worker, [4])  # full: 3 was used least recently
    assert get(worker, [3]).block_hashes == b"" and get(worker, [4]).block_hashes == h(4)
    assert worker.num_bytes == 3 * BLOCK_BYTES


def test_a_corrupt_block_is_refused_and_events_follow_the_store():
    worker = KVStoreWorker(ServiceConfig("kvstore", "s"), 2 * BLOCK_BYTES, lambda: 0)
    put(worker, [1, 2], corrupt=[2])
    assert get(worker, [1, 2]).block_hashes == h(1)
    snapshot = asyncio.run(worker.handle(KVEventsRequest(None), None))
    assert isinstance(snapshot, KVEvents) and snapshot.snapshot and snapshot.stored == h(1)
    put(worker, [3, 4])
    events = asyncio.run(worker.handle(KVEventsRequest(snapshot.last_seq + 1), None))
    assert not events.snapshot and events.removed == h(1) and events.stored == h(3) + h(4)
    bad = asyncio.run(worker.handle(KVStoreGet(LAYOUT, b"short", ()), None))
    assert isinstance(bad, Error) and "16 bytes" in bad.message


def test_blocks_memory_lets_go_are_kept_on_disk_and_served_from_there(tmp_path):
    worker = KVStoreWorker(ServiceConfig("kvstore", "s"), 2 * BLOCK_BYTES, lambda: 0, disk_bytes=2 * BLOCK_BYTES,
                           disk_path=str(tmp_path))
    snapshot = asyncio.run(worker.handle(KVEventsRequest(None), None))
    put(worker, [1, 2, 3, 4])  # 1 and 2 go to disk
    assert worker.num_bytes == 2 * BLOCK_BYTES
    got = get(worker, [1, 2, 3])
    assert got.block_hashes == h(1) + h(2) + h(3)
    assert torch.equal(got.blocks[0][0], torch.full((2, 2, 1, 4, 8), 1.0))
    assert [checksum(b) for b in got.blocks[0]] == list(got.checksums)
    put(worker, [5, 6])  # 3 and 4 to disk, pushing out 1 and 2: gone from the store
    assert get(worker, [1]).block_hashes == b"" and get(worker, [3, 4, 5]).block_hashes == h(3) + h(4) + h(5)
    events = asyncio.run(worker.handle(KVEventsRequest(snapshot.last_seq + 1), None))
    assert set(events.removed[i:i + 16] for i in range(0, len(events.removed), 16)) == {h(1), h(2)}
    # A block whose bytes changed on disk is not served, and leaves the store.
    (disk,) = worker.disks.values()
    disk.slot(disk._entries[h(3)].slot).view(-1)[0] += 1.0
    assert get(worker, [3]).block_hashes == b""
    assert h(3) in asyncio.run(worker.handle(KVEventsRequest(events.last_seq + 1), None)).removed


def test_a_block_goes_only_to_a_getter_that_shows_its_token_ids_and_is_never_replaced(tmp_path):
    worker = KVStoreWorker(ServiceConfig("kvstore", "s"), 2 * BLOCK_BYTES, lambda: 0, disk_bytes=2 * BLOCK_BYTES,
                           disk_path=str(tmp_path))
    put(worker, [1, 2, 3])  # 1 on disk, 2 and 3 in memory
    # Hashes alone (another tenant's guess, or the store's events) do not get the blocks, from memory or disk.
    assert get(worker, [2, 3], token_ids=(7,) * 8).block_hashes == b""
    assert get(worker, [2, 3], token_ids=(2,) * 4 + (7,) * 4).block_hashes == h(2)
    assert get(worker, [1], token_ids=(7,) * 4).block_hashes == b""
    assert get(worker, [1, 2]).block_hashes == h(1) + h(2)
    short = asyncio.run(worker.handle(KVStoreGet(LAYOUT, h(2), ()), None))
    assert isinstance(short, Error) and "token ids" in short.message
    # Other tokens under a held hash (in memory or on disk) are refused and counted; the block stays as it was.
    blocks = torch.stack([torch.full((2, 2, 1, 4, 8), 9.0)] * 2)
    forged = KVStorePut(LAYOUT, h(1) + h(3), (9,) * 8, tuple(checksum(b) for b in blocks), (blocks,))
    refused = asyncio.run(worker.handle(forged, None))
    assert isinstance(refused, Error) and "other token ids" in refused.message
    assert worker.metrics.conflicting_puts._value.get() == 2
    got = get(worker, [1, 2, 3])
    assert got.block_hashes == h(1) + h(2) + h(3)
    assert torch.equal(got.blocks[0][2], torch.full((2, 2, 1, 4, 8), 3.0))


def test_the_store_exports_no_created_series():
    """As every other service (and vLLM): no `_created` series beside each counter. In a process of its own, as a
    store runs: prometheus_client's switch is global, and another module of this one may have thrown it."""
    script = ("from prometheus_client import generate_latest\n"
              "from epdserve.services.kvstore.worker import KVStoreWorker\n"
              "from epdserve.shared.config import ServiceConfig\n"
              "worker = KVStoreWorker(ServiceConfig('kvstore', 's'), 1 << 20, lambda: 0)\n"
              "print(generate_latest(worker.metrics.registry).decode())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "_total" in done.stdout and "_created" not in done.stdout, done.stdout


def test_an_int8_pools_blocks_are_kept_with_their_scales():
    """An int8 pool's layout names its rows' length (head_size + 2: the float16 scale after the values): the store
    takes and gives its blocks as stored, byte for byte, and files them apart from a float pool's."""
    from epdserve.kernels.int8_rows import quantize_rows
    from epdserve.shared.config import kv_row_size

    layout = KVLayout("m", "int8", 4, 2, 1, kv_row_size(8, "int8"))
    worker = KVStoreWorker(ServiceConfig("kvstore", "s"), 1 << 20, lambda: 0)
    blocks = torch.stack([quantize_rows(torch.randn(2, 2, 1, 4, 8) * (i + 1)) for i in (1, 2)])
    message = KVStorePut(layout, h(1) + h(2), (1,) * 4 + (2,) * 4, tuple(checksum(b) for b in blocks), (blocks,))
    assert isinstance(asyncio.run(worker.handle(message, None)), Ack)
    got = get(worker, [1, 2], layout)
    assert got.block_hashes == h(1) + h(2) and torch.equal(got.blocks[0], blocks)
    assert get(worker, [1, 2]).block_hashes == b""  # a float32 pool's layout finds none of them
    short = KVStorePut(layout, h(3), (3,) * 4, (0,), (blocks[:1, ..., :8].contiguous(),))  # rows without scales
    assert isinstance(asyncio.run(worker.handle(short, None)), Error)
