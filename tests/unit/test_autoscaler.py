"""`epdserve up --planner`'s decisions (services/planner/autoscaler.py) from observations written down here, and
the proxy's metrics they are read from."""
import pytest

from epdserve.services.planner.autoscaler import (Autoscaler, Counters, Observation, bounds_for, parse_bounds)
from epdserve.services.planner.layout_model import SLO
from epdserve.services.planner.profile import EngineProfile

BOUNDS = {"prefill": (1, 2), "decode": (1, 3)}
SLOS = SLO(ttft=1.0, tpot=0.05)
# A prompt costs 1 ms a token; a decode step 10 ms plus 1 ms a request.
PROFILE = EngineProfile(model="m", threads=1, context_len=100, max_num_seqs=64,
                        prefill=((10, 0.01), (1000, 1.0)), decode=((1, 0.011), (64, 0.074)))


def seen(rate=1.0, ttft=0.2, tpot=0.02, input_len=100, output_len=50) -> Observation:
    return Observation(rate, input_len, output_len, ttft, tpot)


def test_a_breached_slo_adds_one_instance_of_its_role():
    scaler = Autoscaler(BOUNDS, SLOS)
    decided, reasons = scaler.decide(seen(tpot=0.08), {"prefill": 1, "decode": 1})
    assert decided == {"prefill": 1, "decode": 2}
    assert any("decode: measured mean 0.080 s above the SLO 0.05 s" in r for r in reasons)
    decided, _ = scaler.decide(seen(ttft=1.5, tpot=0.08), {"prefill": 1, "decode": 3})
    assert decided == {"prefill": 2, "decode": 3}  # never past the bounds


def test_fewer_only_after_patience_and_one_at_a_time():
    scaler = Autoscaler(BOUNDS, SLOS, patience=2)
    idle = Observation(0.0, None, None, None, None)
    first, reasons = scaler.decide(idle, {"prefill": 2, "decode": 3})
    assert first == {"prefill": 2, "decode": 3} and any("held at 3" in r for r in reasons)
    second, _ = scaler.decide(idle, {"prefill": 2, "decode": 3})
    assert second == {"prefill": 1, "decode": 2}
    # A busy interval in between starts the count again.
    scaler.decide(idle, {"prefill": 1, "decode": 2})
    scaler.decide(seen(ttft=0.9, tpot=0.04), {"prefill": 1, "decode": 2})
    assert scaler.decide(idle, {"prefill": 1, "decode": 2})[0] == {"prefill": 1, "decode": 2}
    # Never under the bounds.
    assert Autoscaler(BOUNDS, SLOS, patience=1).decide(idle, {"prefill": 1, "decode": 1})[0] == {"prefill": 1,
                                                                                               "decode": 1}


def test_with_a_profile_the_forecast_load_sets_the_counts_before_any_breach():
    scaler = Autoscaler(BOUNDS, SLOS, PROFILE, patience=1)
    # 8 req/s of 100-token prompts: one prefill at 0.8 load waits 0.2 s (TTFT 0.3 s, fine). A decode holds
    # B = 8 x 200 x (0.01 + 0.001 B) requests: no B settles (1.6 > 1); two settle at B = 40 (TPOT 50 ms, the SLO).
    decided, reasons = scaler.decide(seen(rate=8, ttft=0.1, tpot=0.01, output_len=200), {"prefill": 1, "decode": 1})
    assert decided == {"prefill": 1, "decode": 2}
    assert any(r.startswith("predicted for the forecast (8.00 req/s, 100 in / 200 out tokens): 0E1P2D") for r in reasons)
    # The forecast is a moving average: a quiet interval halves the rate, and the plan follows it down.
    decided, _ = scaler.decide(seen(rate=0.0, ttft=None, tpot=None, input_len=None, output_len=None), decided)
    assert scaler.forecast.rate == pytest.approx(4.0)


def test_counters_are_read_from_the_proxys_metrics_and_an_interval_is_their_difference():
    before = Counters.from_metrics("""
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 1.0
# TYPE epdserve:proxy_requests_in_flight gauge
epdserve:proxy_requests_in_flight{model_name="m"} 2.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{model_name="m"} 4.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{model_name="m"} 400.0
vllm:request_prompt_tokens_count{model_name="m"} 4.0
""")
    assert before.finished == 4 and before.in_flight == 2 and before.ttft_count == 4
    after = Counters(finished=10, in_flight=4, failed=1, ttft_sum=5.0, ttft_count=10, prompt_tokens=1000,
                     prompt_count=10, tpot_sum=0.3, tpot_count=6)
    o = Observation.between(before, after, 3.0)
    assert o.rate == pytest.approx((6 + 1 + 2) / 3)  # finished, failed and newly in flight
    assert o.ttft == pytest.approx(0.5) and o.input_len == pytest.approx(100) and o.tpot == pytest.approx(0.05)
    assert o.output_len is None  # nothing counted: no mean


@pytest.mark.parametrize("value, error", [
    ("encoder=1:2", "scales prefill and decode"), ("decode=2:1", "1 <= LOW <= HIGH"), ("decode=0:2", "1 <= LOW"),
    ("decode=1", "ROLE=LOW:HIGH"), ("decode=a:b", "ROLE=LOW:HIGH")])
def test_bounds_are_checked(value, error):
    with pytest.raises(ValueError, match=error):
        parse_bounds(value)


def test_a_role_without_bounds_keeps_the_stacks_count():
    assert bounds_for(parse_bounds("decode=1:4"), prefills=2, decodes=1) == {"prefill": (2, 2), "decode": (1, 4)}
