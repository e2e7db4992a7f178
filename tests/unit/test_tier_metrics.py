"""An engine's KV tiers on /metrics: counters and the restore latency histogram, labelled by tier."""
from prometheus_client import generate_latest

from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.engine.outputs import RESTORE_SECONDS_BUCKETS, EngineStats, KVTierStats


def test_tier_series_carry_the_tiers_counts():
    buckets = [0] * (len(RESTORE_SECONDS_BUCKETS) + 1)
    buckets[2], buckets[-1] = 3, 1
    tier = KVTierStats(10, 64, 9, 144, 9000, 20, 20000, 2, 1, 1, tuple(buckets), 0.75)
    stats = EngineStats(0, 0, 100, 128, 0.2, 0, 0, 0, {}, 0, {}, 0, 0, kv_tiers={"local": tier})
    text = generate_latest(ServiceMetrics("decode", "d0", "m", lambda: stats).registry).decode()
    labels = 'engine="0",engine_id="d0",model_name="m",role="decode",tier="local"'
    assert f"epdserve:kv_tier_hit_blocks_total{{{labels}}} 9.0" in text
    assert f"epdserve:kv_tier_blocks{{{labels}}} 10.0" in text
    assert f"epdserve:kv_tier_failed_restores_total{{{labels}}} 1.0" in text
    with_le = 'engine="0",engine_id="d0",le="{}",model_name="m",role="decode",tier="local"'
    assert f"epdserve:kv_tier_restore_seconds_bucket{{{with_le.format('0.001')}}} 0.0" in text
    assert f"epdserve:kv_tier_restore_seconds_bucket{{{with_le.format('0.0025')}}} 3.0" in text
    assert f"epdserve:kv_tier_restore_seconds_bucket{{{with_le.format('+Inf')}}} 4.0" in text
    assert f"epdserve:kv_tier_restore_seconds_count{{{labels}}} 4.0" in text
    assert f"epdserve:kv_tier_restore_seconds_sum{{{labels}}} 0.75" in text


def test_no_tier_no_tier_series():
    stats = EngineStats(0, 0, 100, 128, 0.2, 0, 0, 0, {}, 0, {}, 0, 0)
    assert "kv_tier" not in generate_latest(ServiceMetrics("decode", "d0", "m", lambda: stats).registry).decode()
