"""The step budget's policies, step by step: when prompts arrive all at once, which step gives each request
its first token, and that no running request misses a step for them.

The schedules are the real scheduler's over the real block manager; the sampled token is the test's (the
scheduler needs some token per finished prompt or decode). Token-for-token exactness of the engine under
either policy is tests/integration/test_hf_exactness.py's.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epdserve.shared.config import BUDGET_POLICIES, SchedulerConfig
from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.engine.request import Request, RequestStatus
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import Scheduler


def make(policy, budget=2048, max_num_seqs=128, num_blocks=1100, block_size=16, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, policy), bm), bm


def req(rid, prompt, max_tokens=128):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=4096)


def burst(sched, n, prompt_len, max_tokens=128):
    """n requests at once, prompts that share no block (distinct first tokens)."""
    requests = [req(f"r{i}", [1000 + i] + [i % 7] * (prompt_len - 1), max_tokens) for i in range(n)]
    for r in requests:
        sched.add_request(r)
    return requests


def run(sched, steps=None):
    """Step until nothing is left (or `steps` steps); per step: (decode tokens, prompt tokens, ids of the
    requests that got their first token), and each request's steps with a token."""
    trace, token_steps = [], {}
    s = 0
    while sched.num_unfinished and (steps is None or s < steps):
        s += 1
        out = sched.schedule()
        decodes = sum(n for r, n in out.scheduled if r.num_output_tokens)
        prompt = sum(n for r, n in out.scheduled if not r.num_output_tokens)
        assert out.num_batched_tokens == decodes + prompt
        got = sched.update_from_output(out, {r.request_id: [7] for r, _ in out.scheduled})
        first = [r.request_id for r in got if r.num_output_tokens == 1]
        for r in got:
            token_steps.setdefault(r.request_id, []).append(s)
        trace.append((decodes, prompt, first))
    return trace, token_steps


def first_token_step(token_steps, n):
    return [token_steps[f"r{i}"][0] for i in range(n)]


def test_all_at_once_prompts_policy_gives_the_32nd_request_its_first_token_in_the_second_step():
    sched, bm = make("prompts")
    burst(sched, 64, 128)
    trace, token_steps = run(sched)
    # 16 whole prompts a step, every running request's token on top.
    assert [(d, p, len(f)) for d, p, f in trace[:5]] == [(0, 2048, 16), (16, 2048, 16), (32, 2048, 16),
                                                         (48, 2048, 16), (64, 0, 0)]
    assert first_token_step(token_steps, 64) == [k // 16 + 1 for k in range(64)]
    # No running request misses a step: tokens in every step from its first to its last.
    for steps in token_steps.values():
        assert len(steps) == 128 and steps == list(range(steps[0], steps[0] + 128))
    assert len(trace) == 4 + 127 and bm.num_free_blocks == bm.num_blocks


def test_all_at_once_shared_policy_is_vllms_schedule():
    sched, _ = make("shared")
    burst(sched, 64, 128)
    trace, token_steps = run(sched, steps=5)
    # The budget counts decodes: 16 prompts, then 15 and a chunk, ...
    assert [(d, p, len(f)) for d, p, f in trace] == [(0, 2048, 16), (16, 2032, 15), (31, 2017, 16),
                                                     (47, 2001, 16), (63, 94, 1)]
    first = first_token_step(token_steps, 64)
    assert first[31] == 3 and first[32] == 3  # the median pair, a step later than under "prompts"
    assert first[:16] == [1] * 16 and first[16:31] == [2] * 15 and first[63] == 5


@pytest.mark.parametrize("policy", BUDGET_POLICIES)
def test_a_step_holds_at_most_the_budget_plus_one_token_per_seat(policy):
    sched, _ = make(policy, budget=300, max_num_seqs=10)
    burst(sched, 30, 40, max_tokens=20)
    bound = 300 + (10 if policy == "prompts" else 0)
    while sched.num_unfinished:
        out = sched.schedule()
        assert out.num_batched_tokens <= bound and len(out.scheduled) <= 10
        sched.update_from_output(out, {r.request_id: [7] for r, _ in out.scheduled})


def test_prompts_are_packed_whole_and_the_one_that_does_not_fit_waits_one_step():
    sched, _ = make("prompts", budget=512)
    burst(sched, 5, 200, max_tokens=4)
    trace, token_steps = run(sched, steps=3)
    # 2 prompts (400): the third (200 > 112 left) waits; under "shared" it would be chunked.
    assert [(d, p, f) for d, p, f in trace] == [(0, 400, ["r0", "r1"]), (2, 400, ["r2", "r3"]),
                                                (4, 200, ["r4"])]
    shared, _ = make("shared", budget=512)
    burst(shared, 5, 200, max_tokens=4)
    shared_trace, _ = run(shared, steps=3)
    # Chunked to fill: the first two end later (512 tokens in), the last three together (1002 in); packed,
    # r0-r1 end 400 tokens in, r2-r3 800, r4 1000.
    assert [(d, p, f) for d, p, f in shared_trace] == [(0, 512, ["r0", "r1"]), (2, 488, ["r2", "r3", "r4"]),
                                                       (5, 0, [])]


def test_a_prompt_longer_than_the_budget_is_chunked_into_what_is_left():
    sched, _ = make("prompts", budget=256)
    short, long = req("short", range(100), max_tokens=2), req("long", range(1000, 1600), max_tokens=2)
    sched.add_request(short)
    sched.add_request(long)
    out = sched.schedule()
    # It could never fit whole: it starts in the 156 tokens the short one left.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 100), ("long", 156)]
    sched.update_from_output(out, {"short": [7]})
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 256)]


def test_a_prompt_that_does_not_fit_starts_chunked_when_no_other_prompt_computes_in_the_step():
    """Drafts took the budget: the waiting prompt gets what is left rather than wait behind them forever."""
    sched, _ = make("prompts", budget=8, block_size=4, num_blocks=64)
    a = req("a", range(3), max_tokens=20)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [7]})
    sched.add_request(req("b", range(100, 106), max_tokens=2))
    a.spec_token_ids = [1, 1, 1, 1]
    out = sched.schedule()
    # a: its token (on top) and 4 drafts; b (6 tokens) does not fit in the 4 left, but no prompt computes.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 4)]


def test_a_prefix_hit_counts_only_the_tokens_still_to_compute():
    sched, _ = make("prompts", budget=40, block_size=4, num_blocks=64)
    shared_prefix = list(range(32))
    first = req("first", shared_prefix + [99], max_tokens=2)
    sched.add_request(first)
    run(sched)
    # 32 of its 36 tokens are cached blocks: 4 to compute, which fit beside the 33-token prompt.
    again = req("again", shared_prefix + [98, 97, 96, 95], max_tokens=2)
    other = req("other", range(200, 233), max_tokens=2)
    sched.add_request(other)
    sched.add_request(again)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("other", 33), ("again", 4)]
    assert again.num_computed_tokens == 32


def test_preemption_under_the_prompts_policy_recomputes_and_finishes_everyone():
    sched, bm = make("prompts", budget=64, block_size=4, num_blocks=12, max_num_seqs=8)
    requests = burst(sched, 4, 8, max_tokens=10)
    preempted = 0
    while sched.num_unfinished:
        out = sched.schedule()
        preempted += len(out.preempted)
        sched.update_from_output(out, {r.request_id: [7] for r, _ in out.scheduled})
    assert preempted > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 10 for r in requests)
    assert bm.num_free_blocks == bm.num_blocks


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="budget_policy"):
        SchedulerConfig(budget_policy="decode-first")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=25),
       st.integers(2, 96), st.integers(1, 10), st.integers(12, 60), st.sampled_from(BUDGET_POLICIES))
def test_no_decode_ever_waits_and_prompts_stay_within_the_budget(arrivals, budget, max_num_seqs, num_blocks, policy):
    """Random arrivals (prompt length, max tokens, steps before the next): every running request whose next
    token is all it computes gets it in every step that preempts nobody, and the step's other tokens fit
    the budget. (Under "shared" too: running requests go first, in arrival order, so a decode is never
    behind a prompt's chunk; what "prompts" changes is how much of the step the prompts get.)"""
    sched, bm = make(policy, budget=budget, max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=4)
    pending = list(enumerate(arrivals))
    while pending or sched.num_unfinished:
        if pending:
            i, (length, max_tokens, wait) = pending.pop(0)
            if bm.num_blocks_for(length + max_tokens) <= num_blocks:
                sched.add_request(req(f"r{i}", [i] + [7] * (length - 1), max_tokens))
        for _ in range(wait if pending else 1):
            decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
            out = sched.schedule()
            if not out.preempted:
                assert {r.request_id for r in decoding} <= {r.request_id for r, _ in out.scheduled}
            assert sum(n for r, n in out.scheduled if r.num_tokens - r.num_computed_tokens != 1) <= budget
            sched.update_from_output(out, {r.request_id: [7] for r, _ in out.scheduled})
    assert bm.num_free_blocks == bm.num_blocks
