"""The draft policy keeps the draft tokens whose expected tokens pay for the rows they add to a step."""
from __future__ import annotations

import pytest

from epdserve.shared.engine.draft_policy import (MAX_REST_STEPS, MIN_GAIN, STALE_STEPS, CostCurve, DraftPolicy,
                                                 StepCost)
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams


def request(name: str, drafts: list[int], hits: float = 0.0, misses: float = 0.0) -> Request:
    r = Request(name, [1, 2, 3], SamplingParams(max_tokens=100), max_model_len=4096)
    r.spec_token_ids = list(drafts)
    r.draft_hits, r.draft_misses = hits, misses
    return r


def policy_with(costs: dict[int, float]) -> DraftPolicy:
    policy = DraftPolicy()
    for rows, seconds in costs.items():
        policy.observe_step(rows, seconds)
    return policy


def test_the_curve_interpolates_between_measured_rows_and_is_flat_past_them():
    curve = CostCurve([2, 6], [0.010, 0.030])
    assert curve(2) == 0.010
    assert curve(4) == pytest.approx(0.020)
    assert curve(1) == 0.010  # below the smallest: the smallest's
    assert curve(50) == 0.030  # above the largest: not measured yet, worth a try
    assert CostCurve([], [])(3) is None


def test_a_row_count_is_a_moving_average_and_forgotten_once_stale():
    cost = StepCost()
    cost.observe(4, 0.010)
    cost.observe(4, 0.020)
    assert 0.010 < cost.curve()(4) < 0.020
    for _ in range(STALE_STEPS):
        cost.observe(1, 0.005)
    assert cost.curve().rows == [1]


def test_before_any_step_is_measured_every_draft_is_kept_room_permitting():
    r = request("a", [5, 6, 7, 8])
    DraftPolicy().trim([r], base_rows=1, base_tokens=1)
    assert r.spec_token_ids == [5, 6, 7, 8]
    DraftPolicy().trim([r], base_rows=1, base_tokens=1, room=2)
    assert r.spec_token_ids == [5, 6]


def test_drafts_that_cost_nothing_are_all_kept():
    r = request("a", [5, 6, 7, 8], hits=1.0, misses=3.0)  # rarely accepted, but free
    policy_with({1: 0.020, 5: 0.020}).trim([r], base_rows=1, base_tokens=1)
    assert r.spec_token_ids == [5, 6, 7, 8]


def test_drafts_whose_rows_cost_more_than_they_bring_are_all_dropped():
    # Four decodes; each row costs as much as a decode yields: a draft pays only if surely accepted.
    rs = [request(str(i), [5, 6, 7, 8], hits=2.0, misses=2.0) for i in range(4)]
    policy_with({4: 0.040, 20: 0.200}).trim(rs, base_rows=4, base_tokens=4)
    assert all(r.spec_token_ids == [] for r in rs)


def test_drafts_that_bring_less_than_the_minimum_gain_are_all_dropped():
    # A large batch: a row costs nearly what a decode yields. Every draft raises the rate a little (all 64 by
    # about 2%), which is less than MIN_GAIN: none is kept.
    rs = [request(str(i), [5], hits=9.0, misses=1.0) for i in range(64)]
    policy = policy_with({64: 0.100, 128: 0.180})
    tokens = 64 + sum(policy.acceptance(r) for r in rs)
    assert 1.0 < (tokens / 0.180) / (64 / 0.100) < 1 + MIN_GAIN
    policy.trim(rs, base_rows=64, base_tokens=64)
    assert all(r.spec_token_ids == [] for r in rs)


def test_a_request_never_verified_has_its_drafts_verified_once():
    policy = policy_with({64: 0.100, 128: 0.180})
    new, known = request("new", [5, 6]), request("known", [5, 6], hits=9.0, misses=1.0)
    policy.trim([new, known], base_rows=64, base_tokens=64)
    assert new.spec_token_ids == [5, 6] and known.spec_token_ids == []


def test_with_no_queue_drafts_that_speed_one_request_and_slow_the_others_more_are_dropped():
    # 16 decodes, one of which copies its prompt: its 4 drafts add ~3.5 tokens a step for 4 rows. With requests
    # queued for a seat, that is what counts (it ends sooner and lets one in): kept. With none, the other 15
    # only wait longer for each of their tokens, more than it gains: dropped.
    def copier():
        return request("copier", [1, 2, 3, 4], hits=40.0, misses=1.0)

    policy = policy_with({16: 0.076, 20: 0.083})
    queued = copier()
    policy.trim([queued], base_rows=16, base_tokens=16, queued=True)
    assert queued.spec_token_ids == [1, 2, 3, 4]
    alone = copier()
    policy.trim([alone], base_rows=16, base_tokens=16, queued=False)
    assert alone.spec_token_ids == []


def test_with_no_queue_drafts_that_speed_every_request_are_kept():
    rs = [request(str(i), [1, 2, 3, 4], hits=40.0, misses=1.0) for i in range(4)]
    policy_with({4: 0.030, 20: 0.036}).trim(rs, base_rows=4, base_tokens=4, queued=False)
    assert all(r.spec_token_ids == [1, 2, 3, 4] for r in rs)


def test_with_no_queue_a_request_first_draft_goes_before_a_likelier_request_second():
    # Room (by cost) for two drafts: the likeliest two tokens are the likely request's first two; what takes
    # the most off the two requests' time per token is a first draft for each.
    def pair():
        return request("likely", [1, 2, 3, 4], hits=40.0, misses=1.0), request("other", [5, 6], hits=3.0, misses=1.0)

    costs = {2: 0.020, 4: 0.021, 10: 0.200}
    likely, other = pair()
    policy_with(costs).trim([likely, other], base_rows=2, base_tokens=2, queued=True)
    assert likely.spec_token_ids == [1, 2] and other.spec_token_ids == []
    likely, other = pair()
    policy_with(costs).trim([likely, other], base_rows=2, base_tokens=2, queued=False)
    assert likely.spec_token_ids == [1] and other.spec_token_ids == [5]


def test_drafts_take_no_more_than_the_room_prompts_leave_in_the_step():
    likely = request("likely", [1, 2, 3, 4], hits=40.0, misses=1.0)
    new = request("new", [5, 6])  # never verified: verified once, room permitting
    policy = policy_with({2: 0.020, 6: 0.020})  # drafts cost nothing: all would be kept
    policy.trim([likely, new], base_rows=2, base_tokens=2, room=3)
    assert likely.spec_token_ids == [1, 2, 3] and new.spec_token_ids == []
    likely.spec_token_ids, new.spec_token_ids = [1, 2], [5, 6]
    policy.trim([likely, new], base_rows=2, base_tokens=2, room=3)
    assert likely.spec_token_ids == [1, 2] and new.spec_token_ids == [5]
    likely.spec_token_ids, new.spec_token_ids = [1, 2], [5, 6]
    policy.trim([likely, new], base_rows=2, base_tokens=2, room=0)
    assert likely.spec_token_ids == [] and new.spec_token_ids == [] and not policy.resting(likely)
    # Room for one draft: the likeliest; the other request's drafts would have paid, so it does not rest.
    other = request("other", [7, 8], hits=30.0, misses=1.0)
    likely.spec_token_ids = [1, 2]
    policy.trim([likely, other], base_rows=2, base_tokens=2, room=1)
    assert likely.spec_token_ids == [1] and other.spec_token_ids == [] and not policy.resting(other)


def test_the_likeliest_drafts_go_first_and_each_request_keeps_a_prefix_of_its_own():
    likely = request("likely", [1, 2, 3, 4], hits=40.0, misses=1.0)
    unlikely = request("unlikely", [5, 6, 7, 8], hits=1.0, misses=10.0)
    # Rows past 2 + 3 cost a lot: about three drafts pay, and they are the likely request's first three.
    policy_with({2: 0.020, 5: 0.024, 10: 0.200}).trim([likely, unlikely], base_rows=2, base_tokens=2)
    assert likely.spec_token_ids == [1, 2, 3]
    assert unlikely.spec_token_ids == []


def test_verifications_keep_a_recent_record_of_hits_and_misses():
    policy = DraftPolicy()
    r = request("a", [])
    prior = policy.acceptance(r)
    policy.observe_verification(r, num_drafts=4, num_accepted=4)  # all accepted: no miss
    assert (r.draft_hits, r.draft_misses) == (4.0, 0.0)
    assert policy.acceptance(r) > prior
    for _ in range(10):
        policy.observe_verification(r, num_drafts=4, num_accepted=0)
    assert r.draft_hits < 1.0 and policy.acceptance(r) < 0.25


def test_a_request_whose_drafts_keep_being_cut_rests_longer_each_time_until_one_is_kept():
    policy = policy_with({4: 0.040, 20: 0.200})  # a draft pays only if surely accepted
    r = request("a", [5, 6], hits=2.0, misses=2.0)
    rests, kept = [], []
    for _ in range(7):
        r.spec_token_ids = [5, 6]
        policy.trim([r], base_rows=4, base_tokens=4)
        kept.append(r.spec_token_ids)
        steps = 0
        while policy.resting(r):
            steps += 1
        rests.append(steps)
    assert rests == [1, 2, 4, 8, 16, MAX_REST_STEPS, MAX_REST_STEPS]
    assert kept == [[]] + [[5]] * 6  # cut, then each time back from its rest: its first draft alone (a probe)
    # Drafts that pay: kept, and the next cut rests one step again, with no probe after it.
    r.spec_token_ids = [5, 6]
    policy_with({4: 0.040, 6: 0.040}).trim([r], base_rows=4, base_tokens=4)
    assert r.spec_token_ids == [5, 6] and not policy.resting(r)
    r.spec_token_ids = [5, 6]
    policy.trim([r], base_rows=4, base_tokens=4)
    assert r.spec_token_ids == [] and policy.resting(r) and not policy.resting(r)


def test_a_request_cut_for_its_misses_is_probed_and_kept_again_once_its_probes_are_accepted():
    # One decode; a draft row costs nearly a third of a step. Its first verifications all missed.
    policy = policy_with({1: 0.028, 5: 0.060})
    r = request("a", [5, 6, 7, 8], hits=0.0, misses=3.0)
    policy.trim([r], base_rows=1, base_tokens=1)
    assert r.spec_token_ids == []
    assert policy.resting(r) and not policy.resting(r)
    r.spec_token_ids = [5, 6, 7, 8]
    policy.trim([r], base_rows=1, base_tokens=1)
    assert r.spec_token_ids == [5]  # the probe
    for _ in range(3):  # the text turned to what the drafts foresee
        policy.observe_verification(r, num_drafts=1, num_accepted=1)
    while policy.resting(r):
        pass
    r.spec_token_ids = [5, 6, 7, 8]
    policy.trim([r], base_rows=1, base_tokens=1)
    assert r.spec_token_ids[:1] == [5] and not policy.resting(r)  # kept because they pay: no rest
