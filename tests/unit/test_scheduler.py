"""Scheduler + block manager: budgets, chunking, preemption, and exact accounting under random traffic.

Sampled tokens are drawn by the test (the scheduler only needs some token per finished step); the full
engine with a real model is exercised in tests/integration.
"""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.engine.kv_connector import KVConnector
from epdserve.shared.config import BUDGET_POLICIES, SchedulerConfig
from epdserve.shared.engine.request import Request, RequestStatus
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, budget=32, caching=True, policy="prompts"):
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, policy), bm), bm


def req(rid, n, max_tokens=4, vocab=3, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=max_tokens,
                   ignore_eos=True), max_model_len=4096)


def step(sched, token=7):
    out = sched.schedule()
    # A group's waiting sequences sample from the row of the one that completes the prompt.
    sampled = {s.request_id: [token] for r, _ in out.scheduled for s in [r, *r.forks]}
    sched.update_from_output(out, sampled)
    return out


def check_invariants(sched, bm):
    held = {}
    for r in sched.requests.values():
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in bm.free_queue)
    for h, block in bm.cached_blocks.items():
        assert block.block_hash == h
    for r in sched.running:
        # Exactly the blocks its computed tokens occupy: a step allocates what it computes, no more.
        assert len(r.block_ids) == bm.num_blocks_for(r.num_computed_tokens)
        assert r.num_computed_tokens <= r.num_tokens


def test_token_budget_chunks_prefill_and_mixes_decodes():
    sched, bm = make_scheduler(num_blocks=64, budget=10, policy="shared")  # decodes count (test_step_budget.py)
    a = req("a", 3, max_tokens=5)
    sched.add_request(a)
    out = step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 3)]
    b = req("b", 25)
    sched.add_request(b)
    out = step(sched)  # a decodes 1, b prefills 9
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0
    step(sched)  # a 1, b 9
    out = step(sched)  # a 1, b 7 (last chunk) -> b gets its first token
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 7)]
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1


def test_max_num_seqs_limits_running():
    sched, _ = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2))
    out = step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_frees_newest_and_recomputes():
    sched, bm = make_scheduler(num_blocks=4, budget=64)
    a, b = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, seed=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # each has 8 computed (2 full blocks) + 1 sampled token: the pool is full
    assert bm.num_free_blocks == 0
    out = step(sched)  # both need a third block: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_ids
    assert sched.waiting[0] is b and b.num_output_tokens == 1  # its token survives preemption
    while sched.num_unfinished:
        step(sched)
        check_invariants(sched, bm)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert bm.num_free_blocks == bm.num_blocks
    # Each prompt was looked up and counted once: b's recompute is not counted again (prompt_stats.py).
    counts = sched.prompt_stats.counts()
    assert counts.prefix_queries == 8 + 8 and sum(counts.by_source.values()) == 8 + 8


def test_request_too_large_for_pool_is_refused():
    sched, _ = make_scheduler(num_blocks=2)
    import pytest

    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("big", 8, max_tokens=4))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(10, 24), st.integers(4, 40), st.booleans(), st.sampled_from(BUDGET_POLICIES))
def test_random_traffic_never_leaks(ops, num_blocks, budget, caching, policy):
    sched, bm = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=budget, caching=caching, policy=policy)
    ids = []
    for i, (op, a, b) in enumerate(ops):
        if op == "add":
            r = req(f"r{i}", a, max_tokens=b, seed=i)
            if bm.num_blocks_for(a + b) <= num_blocks:
                sched.add_request(r)
                ids.append(r.request_id)
        elif op == "step":
            for _ in range(a):
                step(sched, token=i % 3)
        elif ids:
            sched.finish_requests([ids[a % len(ids)]], RequestStatus.FINISHED_ABORTED)
        check_invariants(sched, bm)
    for _ in range(2000):  # everything left runs to completion
        if not sched.num_unfinished:
            break
        step(sched)
        check_invariants(sched, bm)
    assert not sched.num_unfinished
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_cnt == 0 for b in bm.blocks)


def group(rid, n, prompt_len, max_tokens):
    from epdserve.shared.engine.parallel_sampling import make_group

    return make_group(rid, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                      lambda sid, p: Request(sid, list(range(prompt_len)), p, max_model_len=4096))


def test_a_group_holding_every_seat_makes_room_for_a_waiting_request_at_once():
    """n = 8 on an 8-seat engine: once another request waits, the group keeps half the seats (its other
    sequences parked with their KV) and the newcomer is seated in that very step; when it ends, the
    parked ones are seated again, and every sequence still gets all its tokens."""
    sched, bm = make_scheduler(num_blocks=64, max_num_seqs=8, budget=64)
    sched.add_request(group("g", 8, prompt_len=6, max_tokens=20))
    step(sched)  # the prompt, then the fork: all 8 seated, nobody waits
    assert len(sched.running) == 8 and not sched.parked
    late = req("late", 5, max_tokens=3)
    sched.add_request(late)
    out = step(sched)
    assert "late" in [r.request_id for r, _ in out.scheduled]
    assert len(sched.running) == 5 and len(sched.parked) == 4  # 4 of the group + late; 4 parked
    check_invariants(sched, bm)
    while not late.is_finished:
        step(sched)
    step(sched)
    assert len(sched.running) == 8 and not sched.parked
    while sched.num_unfinished:
        step(sched)
        check_invariants(sched, bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.prompt_stats.counts().prefix_queries == 6 + 5  # the group's prompt once, and late's


class Keeper(KVConnector):
    """Keeps the blocks of every finished request it is asked about whose id starts with "keep"."""

    def request_finished(self, request) -> bool:
        return request.request_id.startswith("keep")


def test_a_connector_keeps_a_finished_requests_blocks_until_released_and_an_aborted_one_keeps_none():
    sched, bm = make_scheduler(num_blocks=16)
    sched.loads.connectors.append(Keeper())
    kept, other, aborted = req("keep-a", 6, max_tokens=2), req("b", 6, max_tokens=2, seed=1), req("keep-c", 6, seed=2)
    for r in (kept, other, aborted):
        sched.add_request(r)
    step(sched)
    sched.finish_requests(["keep-c"], RequestStatus.FINISHED_ABORTED)
    while sched.num_unfinished:
        step(sched)
    assert list(sched.held) == ["keep-a"] and kept.kv_held and not other.kv_held and not aborted.kv_held
    assert len(kept.block_ids) == 2 and bm.num_free_blocks == 16 - 2  # out of the pool, nothing else is
    assert all(bm.blocks[b].ref_cnt == 1 for b in kept.block_ids)
    assert sched.release_kv("keep-a") and not sched.release_kv("keep-a") and not sched.release_kv("b")
    assert bm.num_free_blocks == 16 and not sched.held


def spec_step(sched, rng, k=3):
    """One step with draft tokens: every decoding request proposes k, the step accepts a random number of
    those the scheduler kept, and samples one more token after them (never equal to the next draft)."""
    for r in sched.running:
        r.spec_token_ids = [rng.randrange(3) for _ in range(k)] if r.num_computed_tokens == r.num_tokens - 1 else []
    out = sched.schedule()
    sampled = {}
    for r, num_new in out.scheduled:
        num_drafts = max(r.num_computed_tokens + num_new - r.num_tokens, 0)
        assert r.spec_token_ids[:num_drafts] == r.spec_token_ids  # what is left is what is computed
        accepted = rng.randint(0, num_drafts)
        bonus = 3 + rng.randrange(3)  # outside the drafts' range: a mismatch
        sampled[r.request_id] = r.spec_token_ids[:accepted] + [bonus]
        for s in r.forks:
            sampled[s.request_id] = [bonus]
    sched.update_from_output(out, sampled)
    return out


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(10, 24), st.integers(4, 40), st.booleans(), st.integers(0, 10_000),
       st.sampled_from(BUDGET_POLICIES))
def test_random_traffic_with_drafts_never_leaks_and_gives_back_rejected_blocks(ops, num_blocks, budget, caching, seed,
                                                                              policy):
    rng = random.Random(seed)
    sched, bm = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=budget, caching=caching, policy=policy)
    ids = []
    for i, (op, a, b) in enumerate(ops):
        if op == "add":
            r = req(f"r{i}", a, max_tokens=b, seed=i)
            if bm.num_blocks_for(a + b) <= num_blocks:
                sched.add_request(r)
                ids.append(r.request_id)
        elif op == "step":
            for _ in range(a):
                spec_step(sched, rng)
        elif ids:
            sched.finish_requests([ids[a % len(ids)]], RequestStatus.FINISHED_ABORTED)
        check_invariants(sched, bm)  # blocks past the accepted tokens went back
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        spec_step(sched, rng)
        check_invariants(sched, bm)
    assert not sched.num_unfinished
    assert bm.num_free_blocks == bm.num_blocks
    # Only computed tokens were registered: every cached block's tokens are some request's real tokens.
    assert all(b.ref_cnt == 0 for b in bm.blocks)


def test_drafts_fill_the_budget_left():
    sched, bm = make_scheduler(num_blocks=64, budget=6, policy="shared")
    a, b = req("a", 3, max_tokens=20), req("b", 3, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prompts: 6 tokens
    a.spec_token_ids, b.spec_token_ids = [1, 1, 1, 1], [2, 2, 2, 2]
    out = sched.schedule()
    # a: its token and 4 drafts (5); b: its own token, the 1 budget left, no room for drafts.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 1)]
    assert b.spec_token_ids == []
    sched.update_from_output(out, {"a": [1, 1, 9], "b": [4]})
    assert a.output_token_ids == [7, 1, 1, 9] and a.num_computed_tokens == a.num_tokens - 1
    assert len(a.block_ids) == bm.num_blocks_for(a.num_computed_tokens)
    assert sched.spec_stats.num_drafts == 1 and sched.spec_stats.num_accepted_tokens_per_pos == [1, 1]


def test_drafts_fill_the_budget_left_by_prompts_and_drafts_when_decodes_ride_on_top():
    sched, bm = make_scheduler(num_blocks=64, budget=6)
    a, b = req("a", 3, max_tokens=20), req("b", 3, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    a.spec_token_ids, b.spec_token_ids = [1, 1, 1, 1], [2, 2, 2, 2]
    out = sched.schedule()
    # Their own tokens count for nothing: a's 4 drafts take 4 of the 6, b's 2 the rest.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    assert b.spec_token_ids == [2, 2] and out.num_batched_tokens == 8


def test_drafts_give_way_before_anybody_is_preempted():
    sched, bm = make_scheduler(num_blocks=3, budget=32)
    a, b = req("a", 3, max_tokens=4), req("b", 6, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a holds 1 block, b 2: none free
    a.spec_token_ids = [1, 1]  # positions 3..5: a second block
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert not out.preempted and a.spec_token_ids == []
