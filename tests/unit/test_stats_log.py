"""The engine's periodic stats line (services/host/stats_log.py): vLLM's fields, and none while nothing happens."""
from epdserve.services.host import stats_log
from epdserve.services.host.stats_log import StatsLog
from epdserve.shared.engine.outputs import EngineStats


def stats(num_steps=0, running=0, waiting=0, prompt=0, generated=0, queries=0, hits=0, usage=0.0) -> EngineStats:
    return EngineStats(running, waiting, 100, 128, usage, queries, hits, 0, {}, num_steps, {}, prompt, generated)


def test_a_line_for_what_happened_since_the_last_and_none_while_idle(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: now[0])
    state = [stats()]
    log = StatsLog("decode decode-0", lambda: state[0])
    now[0] += 10
    assert log.line() is None  # an idle engine stays quiet
    state[0] = stats(num_steps=40, running=4, waiting=1, prompt=512, generated=300, queries=512, hits=128, usage=0.125)
    now[0] += 10
    assert log.line() == ("decode decode-0: Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 30.0 "
                          "tokens/s, Running: 4 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, "
                          "Prefix cache hit rate: 25.0%")
    now[0] += 5
    assert log.line() is None  # nothing since: no step, the same queues
    state[0] = stats(num_steps=41, prompt=512, generated=301, queries=512, hits=128)
    now[0] += 5
    # The last request's end; its throughput over the 5 s since the previous look, not since the previous line.
    assert log.line().startswith("decode decode-0: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                                 "0.2 tokens/s, Running: 0 reqs, Waiting: 0 reqs")
    now[0] += 5
    assert log.line() is None


def test_speculative_decoding_adds_its_acceptance_over_the_interval(monkeypatch):
    from epdserve.shared.engine.outputs import SpecDecodeCounts

    now = [100.0]
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: now[0])
    state = [stats()._replace(spec_decode=SpecDecodeCounts(10, 40, 30, (10, 9, 6, 5)))]
    log = StatsLog("unified unified-0", lambda: state[0])
    state[0] = stats(num_steps=5, generated=50)._replace(spec_decode=SpecDecodeCounts(20, 80, 50, (19, 15, 9, 7)))
    now[0] += 10
    # 10 runs of 40 draft tokens, 20 of them accepted: 50% of the drafts, 1 + 20 / 10 tokens a run.
    assert log.line().endswith(", Spec decode draft acceptance rate: 50.0%, Mean acceptance length: 3.00")
    state[0] = stats(num_steps=6, generated=51)._replace(spec_decode=SpecDecodeCounts(20, 80, 50, (19, 15, 9, 7)))
    now[0] += 10
    assert log.line().endswith("Prefix cache hit rate: 0.0%")  # no drafts in the interval: nothing to say
