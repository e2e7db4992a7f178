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
    ("unified=1:2", "scales encoder, prefill, decode"), ("decode=2:1", "1 <= LOW <= HIGH"), ("decode=0:2", "1 <= LOW"),
    ("decode=1", "ROLE=LOW:HIGH"), ("decode=a:b", "ROLE=LOW:HIGH")])
def test_bounds_are_checked(value, error):
    with pytest.raises(ValueError, match=error):
        parse_bounds(value)


def test_a_role_without_bounds_keeps_the_stacks_count():
    assert bounds_for(parse_bounds("decode=1:4"), encoders=1, prefills=2, decodes=1) == {
        "encoder": (1, 1), "prefill": (2, 2), "decode": (1, 4)}
    assert parse_bounds("encoder=1:3,prefill=1:2") == {"encoder": (1, 3), "prefill": (1, 2)}
    # A stack without encoders (a model without images) has no encoder to scale.
    assert bounds_for({}, encoders=0, prefills=1, decodes=1) == {"prefill": (1, 1), "decode": (1, 1)}


# -- encoders --------------------------------------------------------------------------------------------------
ALL_BOUNDS = {"encoder": (1, 3), "prefill": (1, 2), "decode": (1, 3)}
ONE_EACH = {"encoder": 1, "prefill": 1, "decode": 1}


def test_a_breached_ttft_adds_to_the_role_its_requests_spent_longer_in():
    scaler = Autoscaler(ALL_BOUNDS, SLOS)
    # Two images of 0.6 s each against a 0.3 s prefill: the encoder is what the first token waited for.
    images_bound = Observation(1.0, 100, 50, ttft=1.5, tpot=0.02, images=2.0, encode=0.6, prefill=0.3)
    decided, reasons = scaler.decide(images_bound, ONE_EACH)
    assert decided == {"encoder": 2, "prefill": 1, "decode": 1}
    assert any(r.startswith("encoder: measured mean 1.500 s above the SLO 1 s") for r in reasons)
    prompt_bound = Observation(1.0, 100, 50, ttft=1.5, tpot=0.02, images=1.0, encode=0.1, prefill=1.4)
    assert scaler.decide(prompt_bound, ONE_EACH)[0] == {"encoder": 1, "prefill": 2, "decode": 1}
    # Without the prefill's own time measured, it is the TTFT less the images'.
    assert Observation(1.0, 100, 50, 1.5, 0.02, images=1.0, encode=0.5).first_token_role() == "prefill"
    assert Observation(1.0, 100, 50, 1.5, 0.02, images=2.0, encode=0.5).first_token_role() == "encoder"
    # An encoder the planner may not scale: the prefill gets one more instead.
    fixed = Autoscaler({"prefill": (1, 2), "decode": (1, 3)}, SLOS)
    assert fixed.decide(images_bound, ONE_EACH)[0] == {"prefill": 2, "decode": 1}


def test_without_a_profile_an_encoder_that_no_image_needs_is_given_back():
    scaler = Autoscaler(ALL_BOUNDS, SLOS, patience=1)
    text_only = Observation(2.0, 100, 50, ttft=0.7, tpot=0.03, images=0.0, encode=None, prefill=0.6)
    decided, reasons = scaler.decide(text_only, {"encoder": 2, "prefill": 1, "decode": 1})
    assert decided == {"encoder": 1, "prefill": 1, "decode": 1} and "encoder: no images" in reasons
    # Nothing finished (images unknown): no change.
    unknown = Observation(2.0, None, None, None, None)
    assert scaler.decide(unknown, {"encoder": 2, "prefill": 1, "decode": 1})[0]["encoder"] == 2


def test_with_a_profile_encoders_are_planned_for_the_images_forecast():
    profile = EngineProfile(model="m", threads=1, context_len=100, max_num_seqs=64,
                            prefill=((10, 0.01), (1000, 1.0)), decode=((1, 0.011), (64, 0.074)), encode=0.1)
    scaler = Autoscaler(ALL_BOUNDS, SLOS, profile, patience=1)
    # 2 images a request, 0.1 s each: at 4 req/s one encoder is loaded 0.8 and waits 0.8 x 0.2 / 0.4 = 0.4 s, a
    # TTFT of 0.73 s with the prompt's 0.1 s and its wait - under the SLO. At 4.5 req/s it waits 0.9 s (TTFT
    # 1.24 s); two wait 0.08 s.
    busy = Observation(4.5, 100, 20, ttft=0.5, tpot=0.02, images=2.0, encode=0.2, prefill=0.2)
    decided, reasons = scaler.decide(busy, ONE_EACH)
    assert decided["encoder"] == 2, reasons
    assert any("4.50 req/s, 100 in / 20 out tokens, 2.00 images): 2E1P" in r for r in reasons)
    # The images stop: the forecast's images halve each interval, and the encoders follow them down to the bound.
    text = Observation(4.5, 100, 20, ttft=0.2, tpot=0.02, images=0.0, encode=None, prefill=0.2)
    decided, _ = scaler.decide(text, decided)
    assert scaler.forecast.images == pytest.approx(1.0) and decided["encoder"] == 1


def test_roles_without_bounds_are_predicted_at_the_counts_they_have():
    # `serve planner --planner-bounds decode=1:3`: the prefills are whatever the stack has (none healthy: one).
    scaler = Autoscaler({"decode": (1, 3)}, SLOS, PROFILE, patience=1)
    decided, reasons = scaler.decide(seen(rate=8, ttft=0.1, tpot=0.01, output_len=200), {"prefill": 0, "decode": 1})
    assert decided == {"decode": 2} and any("0E1P2D" in r for r in reasons)


def test_the_stages_are_read_from_the_proxys_stage_histogram():
    before = Counters.from_metrics("""
# TYPE epdserve:request_stage_seconds histogram
epdserve:request_stage_seconds_sum{model_name="m",stage="proxy.encode"} 3.0
epdserve:request_stage_seconds_count{model_name="m",stage="proxy.encode"} 6.0
epdserve:request_stage_seconds_sum{model_name="m",stage="proxy.prefill"} 1.0
epdserve:request_stage_seconds_count{model_name="m",stage="proxy.prefill"} 4.0
epdserve:request_stage_seconds_sum{model_name="m",stage="encode.compute"} 99.0
epdserve:request_stage_seconds_count{model_name="m",stage="encode.compute"} 99.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{model_name="m"} 400.0
vllm:request_prompt_tokens_count{model_name="m"} 4.0
""")
    assert (before.encode_sum, before.encode_count, before.prefill_sum, before.prefill_count) == (3, 6, 1, 4)
    after = Counters(prompt_tokens=800, prompt_count=8, encode_sum=7.0, encode_count=14, prefill_sum=3.0,
                     prefill_count=8)
    o = Observation.between(before, after, 2.0)
    assert o.images == pytest.approx(2.0) and o.encode == pytest.approx(0.5) and o.prefill == pytest.approx(0.5)
    assert Observation.between(before, before, 2.0).images is None  # no request finished: not known


# -- the proxy's burst-sharing rule --------------------------------------------------------------------------------
def test_prompts_the_proxy_gave_decodes_for_backed_up_prefills_add_a_prefill():
    from epdserve.services.planner.autoscaler import SHARED_REASON
    from epdserve.services.proxy.prefill_queue import REASON

    assert SHARED_REASON == REASON  # the planner counts the proxy's rule by its routing reason
    before = Counters.from_metrics("""
# TYPE epdserve:routing_decisions counter
epdserve:routing_decisions_total{model_name="m",path="decode_only",reason="prefill_queue"} 2.0
epdserve:routing_decisions_total{model_name="m",path="decode_only",reason="short_prompt"} 40.0
epdserve:routing_decisions_total{model_name="m",path="prefill_decode",reason="no_cached_prefix"} 9.0
""")
    assert before.shared == 2
    o = Observation.between(before, Counters(shared=7.0), 1.0)
    assert o.shared == 5
    # Latencies within the SLOs, even under half of them: the decodes did the prefills' work meanwhile.
    scaler = Autoscaler(BOUNDS, SLOS, patience=1)
    busy = Observation(3.0, 100, 50, ttft=0.2, tpot=0.02, shared=5.0)
    decided, reasons = scaler.decide(busy, {"prefill": 1, "decode": 1})
    assert decided["prefill"] == 2
    assert any("prefill: 5 prompt(s) went to decodes, every prefill backed up: one more" in r for r in reasons)
    # None shared: the same latencies give a prefill back.
    assert scaler.decide(Observation(3.0, 100, 50, ttft=0.2, tpot=0.02), {"prefill": 2, "decode": 1})[0][
        "prefill"] == 1
    # With a profile, too: its plan is corrected, whatever it predicted.
    planned = Autoscaler(BOUNDS, SLOS, PROFILE, patience=1)
    assert planned.decide(busy, {"prefill": 1, "decode": 1})[0]["prefill"] == 2


# -- a budget of instances -------------------------------------------------------------------------------------------
def test_what_does_not_fit_the_budget_goes_to_the_role_furthest_over_its_slo():
    # Both over their SLOs, room for one more: the decode is twice its SLO, the prefill 1.5 times.
    scaler = Autoscaler(BOUNDS, SLOS, max_instances=3)
    decided, reasons = scaler.decide(seen(ttft=1.5, tpot=0.1), {"prefill": 1, "decode": 1})
    assert decided == {"prefill": 1, "decode": 2}
    assert "prefill: 2 wanted, held at 1: the budget is 3 instances" in reasons
    # TTFT further over: the prefill first.
    assert Autoscaler(BOUNDS, SLOS, max_instances=3).decide(seen(ttft=3.0, tpot=0.06), {"prefill": 1, "decode": 1})[
        0] == {"prefill": 2, "decode": 1}
    # What is retired makes room in the same interval.
    idle_prefill = Autoscaler(BOUNDS, SLOS, patience=1, max_instances=3)
    assert idle_prefill.decide(seen(ttft=0.2, tpot=0.1), {"prefill": 2, "decode": 1})[0] == {"prefill": 1, "decode": 2}
    # Without a budget both grow.
    assert Autoscaler(BOUNDS, SLOS).decide(seen(ttft=1.5, tpot=0.1), {"prefill": 1, "decode": 1})[0] == {
        "prefill": 2, "decode": 2}


def test_the_predicted_layout_is_the_fewest_within_the_budget():
    busy = seen(rate=8, ttft=0.1, tpot=0.01, output_len=200)  # two decodes predicted (see above)
    assert Autoscaler(BOUNDS, SLOS, PROFILE, patience=1, max_instances=3).decide(busy, {"prefill": 1, "decode": 1})[
        0] == {"prefill": 1, "decode": 2}
    # No layout of two instances meets the SLOs: the most of each role is wanted, and the budget holds it.
    decided, reasons = Autoscaler(BOUNDS, SLOS, PROFILE, patience=1, max_instances=2).decide(
        busy, {"prefill": 1, "decode": 1})
    assert decided == {"prefill": 1, "decode": 1}
    assert any(r.startswith("no layout within the bounds meets the SLOs") for r in reasons)
    assert "decode: 3 wanted, held at 1: the budget is 2 instances" in reasons
