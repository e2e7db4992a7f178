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
    rests = []
    for _ in range(7):
        r.spec_token_ids = [5, 6]
        policy.trim([r], base_rows=4, base_tokens=4)
        assert r.spec_token_ids == []
        steps = 0
        while policy.resting(r):
            steps += 1
        rests.append(steps)
    assert rests == [1, 2, 4, 8, 16, MAX_REST_STEPS, MAX_REST_STEPS]
    # Drafts that pay: kept, and the next cut rests one step again.
    r.spec_token_ids = [5, 6]
    policy_with({4: 0.040, 6: 0.040}).trim([r], base_rows=4, base_tokens=4)
    assert r.spec_token_ids == [5, 6] and not policy.resting(r)
    r.spec_token_ids = [5, 6]
    policy.trim([r], base_rows=4, base_tokens=4)
    assert policy.resting(r) and not policy.resting(r)
