"""Admission control's estimate: queued prompt tokens over the rate learnt from prefill-sized steps."""
from epdserve.shared.engine.queue_estimate import MIN_TOKENS_FOR_RATE, SMOOTHING, QueueEstimate


def test_no_estimate_until_a_prefill_sized_step_was_seen():
    estimate = QueueEstimate()
    estimate.observe_step(MIN_TOKENS_FOR_RATE - 1, 0.01, queued_tokens=10_000)  # a few decodes: no rate
    assert estimate.tokens_per_second is None and estimate.seconds == 0.0
    estimate.observe_step(2048, 1.0, queued_tokens=10_240)
    assert estimate.seconds == 5.0


def test_the_rate_is_a_moving_average_and_an_empty_queue_waits_nothing():
    estimate = QueueEstimate()
    estimate.observe_step(1000, 1.0, queued_tokens=0)
    estimate.observe_step(2000, 1.0, queued_tokens=0)
    assert estimate.tokens_per_second == SMOOTHING * 2000 + (1 - SMOOTHING) * 1000
    assert estimate.seconds == 0.0
