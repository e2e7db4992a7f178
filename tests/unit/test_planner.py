"""The planner's queueing model and ranking, on profiles written down here (no engine)."""
import math
import statistics

import numpy as np
import pytest

from epdserve.services.planner.layout_model import (SLO, Layout, Traffic, _median_interruptions, _median_wait,
                                                    goodput, predict)
from epdserve.services.planner.plan import candidates, plan
from epdserve.services.planner.profile import EngineProfile

# A prompt costs 1 ms a token; a decode step 10 ms plus 1 ms a request.
PROFILE = EngineProfile(model="m", threads=1, context_len=100, max_num_seqs=64,
                        prefill=((10, 0.01), (100, 0.1), (1000, 1.0)), decode=((1, 0.011), (8, 0.018), (64, 0.074)),
                        encode=0.05)


def test_measured_points_are_interpolated_and_extrapolated_along_the_last_two():
    assert PROFILE.prefill_seconds(100) == pytest.approx(0.1)
    assert PROFILE.prefill_seconds(550) == pytest.approx(0.55)
    assert PROFILE.prefill_seconds(2000) == pytest.approx(2.0)
    assert PROFILE.step_seconds(4) == pytest.approx(0.014)
    assert PROFILE.step_seconds(0) == PROFILE.step_seconds(1)  # an empty step is never cheaper than one request
    one = EngineProfile("m", 1, 10, 8, prefill=((10, 0.02),), decode=((4, 0.04),))
    assert one.prefill_seconds(20) == pytest.approx(0.04) and one.step_seconds(2) == pytest.approx(0.02)


def test_a_profile_reads_back_as_saved(tmp_path):
    PROFILE.save(tmp_path / "p.json")
    assert EngineProfile.load(tmp_path / "p.json") == PROFILE
    (tmp_path / "bad.json").write_text('{"model": "m"}')
    with pytest.raises(ValueError, match="not a profile"):
        EngineProfile.load(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text('{"model": "m", "threads": 1, "context_len": 1, "max_num_seqs": 1, '
                                         '"prefill": [], "decode": [[1, 0.1]]}')
    with pytest.raises(ValueError, match="needs measured prefill and decode points"):
        EngineProfile.load(tmp_path / "empty.json")


def test_disaggregated_ttft_is_mdl1_over_the_prefills_and_tpot_the_decodes_fixed_point():
    traffic = Traffic(rate=5, input_len=100, output_len=50)
    p = predict(PROFILE, traffic, Layout(prefills=1, decodes=1))
    # Prefill: work 0.1 s, load 0.5: waits 0.5 * 0.1 / (2 * 0.5) = 0.05 s.
    assert p.load["prefill"] == pytest.approx(0.5)
    assert p.ttft == pytest.approx(0.15)
    # Decode: B = 5 * 50 * (0.01 + 0.001 B) -> B = 2.5 / 0.75.
    assert p.batch == pytest.approx(2.5 / 0.75, rel=1e-4)
    assert p.tpot == pytest.approx(0.01 + 0.001 * p.batch, rel=1e-4)
    # Twice the prefills halve the load; the decodes are untouched.
    two = predict(PROFILE, traffic, Layout(prefills=2, decodes=1))
    assert two.ttft == pytest.approx(0.1 + 0.25 * 0.1 / 1.5) and two.tpot == pytest.approx(p.tpot)


def test_unified_steps_are_stretched_by_the_share_of_time_on_prompts_and_by_the_prompts_queued_behind():
    traffic = Traffic(rate=5, input_len=100, output_len=50)
    p = predict(PROFILE, traffic, Layout(unified=1))
    assert p.load["unified"] == pytest.approx(0.5)
    # Prompts queued behind a request at its first token (its wait 0.05 s and prefill 0.1 s) are computed during
    # its 49 gaps too: rho (W + S_p) / ((1 - rho) 49) more a token.
    step = PROFILE.step_seconds(p.batch)
    assert p.tpot == pytest.approx(step * 2 + 0.5 * 0.15 * 2 / 49)
    assert p.batch == pytest.approx(5 * 50 * p.tpot, rel=1e-4)  # Little's law
    assert p.tpot > predict(PROFILE, traffic, Layout(prefills=1, decodes=1)).tpot
    # Its median: half of the prompts wait nowhere (rho 0.5); a request meets the prompts arriving in its prefill
    # and its 49 steps, and those arriving during theirs.
    assert p.ttft_p50 == pytest.approx(0.1 + step / 2)
    assert p.tpot_p50 == pytest.approx(step + 0.1 * _median_interruptions(5 * (0.1 + 49 * step), 0.5) / 49)
    assert p.ttft_p50 < p.ttft and p.tpot_p50 < p.tpot


def simulated_median_wait(queues: list[tuple[float, float]], n: int = 100_000) -> float:
    """The median of the summed waits of independent M/D/1 queues (arrivals, work), by Lindley's recursion
    over n seeded arrivals each."""
    rng = np.random.default_rng(0)
    total = np.zeros(n)
    for arrivals, work in queues:
        gaps, wait = rng.exponential(1 / arrivals, n), 0.0
        for i in range(n):
            total[i] += wait
            wait = max(0.0, wait + work - gaps[i])
    return float(np.median(total))


def test_median_waits_are_erlangs_m_d_1():
    # Half the requests or more find the queue empty: no wait at the median.
    assert _median_wait([(1.0, 0.5)]) == 0 and _median_wait([(2.0, 0.1), (1.0, 0.3)]) == 0  # 0.8 x 0.7 of none
    # Within one work a wait is at most t with probability (1 - rho) e^(arrivals t): the median solves it = 1/2.
    assert _median_wait([(1.2, 0.5)]) == pytest.approx(math.log(0.5 / 0.4) / 1.2, abs=0.5 / 64)
    # Beyond one work (Erlang's later terms), and two queues one after another, against a simulation.
    for queues in ([(1.8, 0.5)], [(2.0, 0.4)], [(1.6, 0.3), (1.0, 0.5)]):
        assert _median_wait(queues) == pytest.approx(simulated_median_wait(queues), rel=0.03, abs=0.01), queues
    assert math.isinf(_median_wait([(2.0, 0.5)]))


def test_the_prompts_a_unified_request_meets_have_a_branching_process_median():
    rng = np.random.default_rng(0)

    def simulated(expected: float, load: float, n: int = 20_000) -> float:
        totals = []
        for first in rng.poisson(expected, n):
            total = pending = int(first)
            while pending:
                children = int(rng.poisson(load))
                total, pending = total + children, pending - 1 + children
            totals.append(total)
        return statistics.median_low(totals)  # the least count with half the mass at or below it

    assert _median_interruptions(0.5, 0.3) == 0  # e^-0.5 > 1/2: most meet none
    assert _median_interruptions(3.2, 0.0) == 3  # no prefill brings more: Poisson's median
    for expected, load in ((1.3, 0.4), (2.5, 0.6), (4.2, 0.3)):
        assert _median_interruptions(expected, load) == simulated(expected, load), (expected, load)


def test_an_overloaded_role_has_no_steady_state():
    p = predict(PROFILE, Traffic(rate=11, input_len=100, output_len=50), Layout(prefills=1, decodes=1))
    assert p.load["prefill"] > 1 and math.isinf(p.ttft)
    # 64 requests at most: at 100 req/s x 50 tokens x >= 10 ms a step, a decode would need more.
    p = predict(PROFILE, Traffic(rate=100, input_len=10, output_len=50), Layout(prefills=1, decodes=1))
    assert math.isinf(p.batch) and math.isinf(p.tpot)


def test_images_go_through_the_encoders():
    traffic = Traffic(rate=2, input_len=100, output_len=10, images=2)
    p = predict(PROFILE, traffic, Layout(encoders=1, prefills=1, decodes=1))
    assert p.load["encoder"] == pytest.approx(0.2)
    text_only = predict(PROFILE, Traffic(2, 100, 10), Layout(prefills=1, decodes=1))
    assert p.ttft == pytest.approx(text_only.ttft + 0.1 + 0.2 * 0.1 / 1.6)
    with pytest.raises(ValueError, match="need an encoder"):
        predict(PROFILE, traffic, Layout(prefills=1, decodes=1))
    with pytest.raises(ValueError, match="no vision tower"):
        predict(EngineProfile("m", 1, 1, 8, ((1, 1.0),), ((1, 1.0),)), traffic, Layout(encoders=1, unified=1))


def test_goodput_is_the_highest_rate_within_both_slos():
    traffic, slo, layout = Traffic(1, 100, 50), SLO(ttft=0.2, tpot=0.05), Layout(prefills=1, decodes=1)
    rate = goodput(PROFILE, traffic, layout, slo)
    assert predict(PROFILE, Traffic(rate, 100, 50), layout).meets(slo)
    assert not predict(PROFILE, Traffic(rate * 1.01, 100, 50), layout).meets(slo)
    assert goodput(PROFILE, traffic, layout, SLO(ttft=0.05, tpot=1)) == 0  # a prompt alone takes 0.1 s


def test_layouts_are_ranked_fewest_instances_meeting_the_slos_first():
    assert [str(layout) for layout in candidates(Traffic(1, 10, 10), 3)] == ["1U", "0E1P1D", "0E1P2D", "0E2P1D"]
    assert [str(layout) for layout in candidates(Traffic(1, 10, 10, images=1), 3)] == ["1E+1U", "1E1P1D"]
    # Light traffic: one unified engine meets both, and it is the fewest instances.
    ranked = plan(PROFILE, Traffic(1, 100, 50), SLO(ttft=0.5, tpot=0.05), max_instances=4)
    assert str(ranked[0].layout) == "1U" and ranked[0].meets
    # Prompts that take most of a unified engine's time: its TPOT breaks the SLO; a prefill of their own fixes it.
    ranked = plan(PROFILE, Traffic(8, 100, 50), SLO(ttft=1.0, tpot=0.05), max_instances=4)
    assert str(ranked[0].layout) == "0E1P1D" and ranked[0].meets
    assert not next(c for c in ranked if c.layout.unified).meets
    # Nothing meets them: the most goodput first.
    ranked = plan(PROFILE, Traffic(50, 100, 50), SLO(ttft=0.2, tpot=0.02), max_instances=3)
    assert not any(c.meets for c in ranked)
    assert [c.goodput for c in ranked] == sorted((c.goodput for c in ranked), reverse=True)


def test_a_layout_is_checked_and_spelled_as_epdserve_up_takes_it():
    assert Layout(prefills=2, decodes=1).up_args() == ["--prefills", "2", "--decodes", "1"]
    assert Layout(encoders=1, unified=1).up_args() == ["--encoders", "1", "--unified"]
    with pytest.raises(ValueError, match="one unified engine"):
        Layout(unified=2).up_args()
    for bad in (dict(prefills=1), dict(unified=1, decodes=1), dict(), dict(prefills=-1, decodes=1)):
        with pytest.raises(ValueError):
            Layout(**bad)
