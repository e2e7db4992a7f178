"""The router's view of engines' offload tiers: tier events follow the pool's numbering, and a tier's blocks
count, at their weight, right after the pool's leading ones."""
import random

from epdserve.services.proxy.prefix_index import STORE, PrefixIndex
from epdserve.shared.engine.kv_events import KVEventLog

H = [bytes([i]) * 16 for i in range(10)]


def test_tier_blocks_count_after_the_pools_at_their_weight():
    index = PrefixIndex()
    # a: the pool holds the head, the tier the evicted tail; b: the tier holds it all; c: the pool, a gap.
    index.apply("a", 1, 1, H[:3], (), tier_stored=H[3:8])
    index.apply("b", 1, 1, (), (), tier_stored=H[:6])
    index.apply("c", 1, 1, H[:2], (), tier_stored=H[5:])
    held, elsewhere = index.match_weighted(H, 0.5)
    assert held == {"a": 3 + 0.5 * 5, "b": 0.5 * 6, "c": 2} and elsewhere == 0
    assert index.match_weighted(H, 0) == ({"a": 3, "c": 2}, 0)
    assert index.match(H) == {"a": 3, "c": 2}


def test_store_blocks_count_for_everyone_after_what_each_holds():
    index = PrefixIndex()
    index.apply("a", 1, 1, H[:2], (), tier_stored=H[2:4])
    index.apply("b", 1, 1, H[:1], ())
    index.store.apply(STORE, 1, 1, H[:7], ())
    held, elsewhere = index.match_weighted(H, 0.5, 0.25)
    # a: 2 in its pool, 2 in its tier, then 3 more (blocks 4-6) from the store; b: 1, then 6 from the store.
    assert held == {"a": 2 + 0.5 * 2 + 0.25 * 3, "b": 1 + 0.25 * 6} and elsewhere == 0.25 * 7
    index.store.drop(STORE)  # the store is gone: it counts for nobody
    assert index.match_weighted(H, 0.5, 0.25) == ({"a": 3.0, "b": 1.0}, 0)


def _run(holds: set[bytes], hashes: list[bytes], start: int) -> int:
    n = start
    while n < len(hashes) and hashes[n] in holds:
        n += 1
    return n - start


def test_match_weighted_equals_counting_block_by_block_on_random_holdings():
    rng = random.Random(0)
    hashes = [bytes([i]) * 16 for i in range(40)]
    for _ in range(50):
        index, pools, tiers = PrefixIndex(), {}, {}
        for name in (f"i{k}" for k in range(rng.randrange(1, 30))):
            # Mostly heads of the prompt (shared system prompts), with holes and tails elsewhere.
            pools[name] = set(hashes[:rng.randrange(0, 40)]) - set(rng.sample(hashes, rng.randrange(0, 3)))
            tiers[name] = set(rng.sample(hashes, rng.randrange(0, 40)))
            index.apply(name, 1, 1, list(pools[name]), (), tier_stored=list(tiers[name]))
        store = set(rng.sample(hashes, rng.randrange(0, 40)))
        index.store.apply(STORE, 1, 1, list(store), ())
        expected = {}
        for name in pools:
            pool = _run(pools[name], hashes, 0)
            tier = _run(tiers[name], hashes, pool)
            weight = pool + 0.5 * tier + 0.25 * _run(store, hashes, pool + tier)
            if pool or tier:
                expected[name] = weight
        held, elsewhere = index.match_weighted(hashes, 0.5, 0.25)
        assert {k: v for k, v in held.items() if k in expected} == expected
        assert all(v == 0.25 * _run(store, hashes, 0) for k, v in held.items() if k not in expected)
        assert elsewhere == 0.25 * _run(store, hashes, 0)
        assert index.match(hashes) == {k: n for k in pools if (n := _run(pools[k], hashes, 0))}


def test_a_gap_in_the_numbering_resyncs_the_tier_with_the_pool():
    index = PrefixIndex()
    assert index.apply("a", 1, 1, H[:1], (), tier_stored=H[1:4])
    assert not index.apply("a", 3, 3, (), (), tier_removed=H[1:2])  # batch 2 lost
    assert index.match_weighted(H, 1.0) == ({}, 0)
    assert index.apply("a", 0, 4, H[:2], (), snapshot=True, tier_stored=H[2:5])
    assert index.match_weighted(H, 1.0) == ({"a": 5}, 0)
    index.drop("a")
    assert index.tier.match(H) == {}


def test_the_event_log_merges_each_tiers_changes_in_order():
    log = KVEventLog()
    log.stored(H[0])
    log.tier_changed("local", [H[1], H[2]], [])
    log.seal()
    log.tier_changed("local", [], [H[1]])
    log.removed(H[0])
    log.seal()
    batch = log.since(1, ())
    assert (batch.stored, batch.removed) == ((), (H[0],))
    (local,) = batch.tiers
    assert (local.tier, local.stored, local.removed) == ("local", (H[2],), (H[1],))
    snapshot = log.since(None, [H[3]], {"local": [H[2]]})
    assert snapshot.snapshot and snapshot.stored == (H[3],) and snapshot.tiers[0].stored == (H[2],)
    log.seal()  # nothing changed: no new number
    assert log.last_seq == 2
