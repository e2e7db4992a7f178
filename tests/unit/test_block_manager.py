"""Block manager: exact block ids, reference counts and eviction order in scripted scenarios."""
import pytest

from epdserve.shared.block_hash import hash_block
from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.engine.request import Request
from epdserve.shared.processing.multimodal import MultiModalPlaceholder
from epdserve.shared.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens, **kwargs):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), max_model_len=1024, **kwargs)


def schedule(bm, request):
    """What the scheduler does for a new request: look up hits, allocate, compute, register."""
    hits, num_cached = bm.get_computed_blocks(request)
    num_new = request.num_tokens - num_cached
    assert bm.can_allocate(request, num_new, hits)
    bm.allocate(request, num_new, hits)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return num_cached


def ref_counts(bm):
    return {b.block_id: b.ref_cnt for b in bm.blocks if b.ref_cnt}


def test_allocate_share_free_and_evict_in_lru_order():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(10))  # 2 full blocks + 2 tokens
    assert schedule(bm, a) == 0
    assert a.block_ids == [0, 1, 2]
    assert ref_counts(bm) == {0: 1, 1: 1, 2: 1}
    assert len(bm.cached_blocks) == 2  # only full blocks are cached

    b = make_request("b", [*range(8), 99])  # shares a's two full blocks
    assert schedule(bm, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert ref_counts(bm) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert bm.num_free_blocks == 6

    bm.free(a)
    # Block 2 held no cached content: it goes to the front, to be reused first.
    assert list(bm.free_queue) == [2, 4, 5, 6, 7, 8, 9]
    bm.free(b)
    # Cached blocks join the tail, the prefix's last block before its first.
    assert list(bm.free_queue) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert bm.num_free_blocks == bm.num_blocks and not ref_counts(bm)

    c = make_request("c", range(100, 132))  # 8 blocks: takes every uncached block
    schedule(bm, c)
    assert c.block_ids == [2, 3, 4, 5, 6, 7, 8, 9]  # in ascending order: one run in the cache
    assert len(bm.cached_blocks) == 2 + 8
    d = make_request("d", [200])  # one more block: evicts block 1 (prefix tail), keeps block 0
    schedule(bm, d)
    assert d.block_ids == [1]
    e = make_request("e", [*range(8), 7])
    hits, num_cached = bm.get_computed_blocks(e)
    assert [blk.block_id for blk in hits] == [0] and num_cached == 4


def test_a_freed_table_is_reused_as_one_ascending_run():
    """Freed tables join the queue reversed; the next request still gets them as consecutive ids, so
    that a KV transfer moves its blocks as one run instead of block by block."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    a, b = make_request("a", range(40)), make_request("b", range(100, 140))
    schedule(bm, a)
    schedule(bm, b)
    assert a.block_ids == list(range(10)) and b.block_ids == list(range(10, 20))
    bm.free(b)
    bm.free(a)
    assert list(bm.free_queue) == [*range(20, 32), *range(19, 9, -1), *range(9, -1, -1)]
    c = make_request("c", range(200, 240))
    schedule(bm, c)
    assert c.block_ids == list(range(20, 30))
    d = make_request("d", range(300, 340))  # the last 2 never-used blocks, then b's, its prefix tail first
    schedule(bm, d)
    assert d.block_ids == [*range(12, 20), 30, 31]


def test_last_prompt_token_is_always_recomputed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    schedule(bm, make_request("a", range(8)))
    same = make_request("b", range(8))
    hits, num_cached = bm.get_computed_blocks(same)
    assert [blk.block_id for blk in hits] == [0] and num_cached == 4


def test_hit_is_verified_against_token_ids():
    bm = BlockManager(num_blocks=8, block_size=BS)
    schedule(bm, make_request("a", range(9)))
    # Plant a block under the hash of different tokens, as a hash collision would.
    other = make_request("b", [5, 5, 5, 5, 5])
    bm._update_block_hashes(other)
    bm.cached_blocks[other.block_hashes[0]] = bm.blocks[0]
    hits, num_cached = bm.get_computed_blocks(other)
    assert hits == [] and num_cached == 0


@pytest.mark.parametrize("field", ["cache_salt", "mm"])
def test_extra_keys_separate_equal_tokens(field):
    def req(rid, value):
        if field == "cache_salt":
            return make_request(rid, range(9), cache_salt=value)
        return make_request(rid, range(9), mm_placeholders=(MultiModalPlaceholder(2, 4, value),))

    bm = BlockManager(num_blocks=16, block_size=BS)
    schedule(bm, req("a", "x"))
    assert bm.get_computed_blocks(req("b", "y"))[1] == 0
    assert bm.get_computed_blocks(req("c", "x"))[1] == 8


def test_mm_hash_only_affects_overlapping_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    ph = lambda h: (MultiModalPlaceholder(offset=5, length=2, mm_hash=h),)  # inside block 1
    schedule(bm, make_request("a", range(13), mm_placeholders=ph("x")))
    hits, num_cached = bm.get_computed_blocks(make_request("b", range(13), mm_placeholders=ph("y")))
    assert num_cached == 4  # block 0 is shared, block 1 (and so every later one) differs


def test_hash_is_chained_and_stable():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hash_block(None, [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt:a",)) != h0


def test_can_allocate_counts_hit_blocks_leaving_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(9))  # 3 blocks
    schedule(bm, a)
    bm.free(a)
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54])  # 2 hits + needs 2 more blocks: 4 > 3
    hits, num_cached = bm.get_computed_blocks(b)
    assert num_cached == 8
    assert not bm.can_allocate(b, b.num_tokens - num_cached, hits)
    c = make_request("c", [*range(8), 50])  # 2 hits + 1 new block
    hits, num_cached = bm.get_computed_blocks(c)
    assert bm.can_allocate(c, 1, hits)
    bm.allocate(c, 1, hits)
    assert c.block_ids == [0, 1, 2] and bm.num_free_blocks == 0


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    schedule(bm, make_request("a", range(9)))
    assert bm.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert not bm.cached_blocks


def test_duplicate_block_stays_private():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", range(5)), make_request("b", range(5))
    for r in (a, b):  # both allocated before either is computed: no hit for b
        bm.allocate(r, 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.cache_full_blocks(r)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    assert bm.cached_blocks[a.block_hashes[0]] is bm.blocks[0]
    assert bm.blocks[2].block_hash is None  # b's copy was never registered...
    bm.free(b)
    assert list(bm.free_queue)[:2] == [2, 3]  # ...so it is reused first
