"""The offload tier's file: LRU by block hash, pinned blocks never reused, checksums of what was written."""
import torch

from epdserve.shared.engine.offload_file import OffloadFile, checksum

SHAPE = (2, 2, 1, 4, 8)


def block(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value)


def saved(f: OffloadFile, name: bytes, value: float) -> None:
    assert f.reserve(name, (1, 2)) is not None
    f.write(name, block(value))


def test_a_full_file_reuses_its_least_recently_used_block(tmp_path):
    f = OffloadFile(str(tmp_path / "t.bin"), 2, SHAPE, torch.float32, unlink=True)
    saved(f, b"a", 1.0)
    saved(f, b"b", 2.0)
    assert f.num_hits([b"a"], [(1, 2)]) == 1  # a used now: b is the oldest
    saved(f, b"c", 3.0)
    assert sorted(f.hashes()) == [b"a", b"c"]
    assert f.take_changes() == ([b"a", b"b", b"c"], [b"b"])
    assert f.num_hits([b"a", b"c"], [(1, 2), (9, 9)]) == 1  # tokens differ: not a hit
    assert f.reserve(b"a", (1, 2)) is None  # held already
    (slot, digest), = f.pin([b"c"])
    assert torch.equal(f.slot(slot), block(3.0)) and checksum(f.slot(slot)) == digest
    f.unpin([b"c"], [slot])
    f.close()


def test_a_pinned_block_is_not_reused_and_a_corrupt_one_is_dropped_after_its_read(tmp_path):
    f = OffloadFile(str(tmp_path / "t.bin"), 1, SHAPE, torch.float32)
    saved(f, b"a", 1.0)
    pinned = f.pin([b"a"])
    assert f.reserve(b"b", ()) is None  # its only slot is being read
    assert f.pin([b"zz"]) is None
    f.unpin([b"a"], [pinned[0][0]], corrupt=[b"a"])
    assert f.hashes() == [] and f.num_blocks == 0
    assert f.reserve(b"b", ()) is not None  # the slot is free again
    f.unreserve(b"b")
    assert f.reserve(b"b", ()) is not None
    f.close()
