"""The engine's KV event log and the router's index fed by it end up agreeing on what is cached."""
import random

import pytest

from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.shared.engine.kv_events import KVEventLog


def apply(index: PrefixIndex, name: str, batch) -> bool:
    return index.apply(name, batch.first_seq, batch.last_seq, batch.stored, batch.removed, batch.snapshot)


@pytest.mark.parametrize("seed", range(5))
def test_merged_batches_and_snapshots_track_the_cache_exactly(seed):
    rng = random.Random(seed)
    log, held, index = KVEventLog(max_batches=8), set(), PrefixIndex()
    universe = [bytes([i]) * 16 for i in range(40)]
    for step in range(300):
        for _ in range(rng.randrange(4)):
            h = rng.choice(universe)
            if h in held:
                held.discard(h)
                log.removed(h)
            else:
                held.add(h)
                log.stored(h)
        log.seal()
        if step % rng.choice([1, 3, 7, 20]) == 0:  # polls at uneven intervals; far apart ones need a snapshot
            batch = log.since(index.next_seq("e"), held)
            if not apply(index, "e", batch):
                assert apply(index, "e", log.since(None, held))
            assert {k for k in universe if index.match([k])} == held


def test_nothing_new_is_an_empty_batch_that_follows():
    log, index = KVEventLog(), PrefixIndex()
    batch = log.since(1, [])
    assert (batch.first_seq, batch.last_seq, batch.stored, batch.snapshot) == (1, 0, (), False)
    assert apply(index, "e", batch)
    log.stored(b"x" * 16)
    log.seal()
    assert apply(index, "e", log.since(index.next_seq("e"), [b"x" * 16]))
    assert index.match([b"x" * 16]) == {"e": 1}


def test_a_restarted_engine_is_resynced_by_snapshot():
    index = PrefixIndex()
    old = KVEventLog()
    for i in range(5):
        old.stored(bytes([i]) * 16)
        old.seal()
    assert apply(index, "e", old.since(index.next_seq("e"), []))
    new = KVEventLog()  # the engine restarted: empty cache, numbers from 1
    new.stored(b"\x09" * 16)
    new.seal()
    # Asked for batch 6, which it never made, it answers with a snapshot.
    batch = new.since(index.next_seq("e"), [b"\x09" * 16])
    assert batch.snapshot and apply(index, "e", batch)
    assert index.match([b"\x00" * 16]) == {} and index.match([b"\x09" * 16]) == {"e": 1}
