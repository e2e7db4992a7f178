"""The goodput benchmark's serving-free parts: its workload, its SLO scoring, its report and --rescore."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
VOCAB = 49152


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("goodput", BENCHMARKS / "goodput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["goodput"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for goodput_report and stacks
    return module


@pytest.fixture(scope="module")
def report_module(bench):
    return sys.modules["goodput_report"]


def test_workload_is_seeded_and_mixed_as_asked(bench):
    args = bench.parse_args([])
    first = bench.workload(args, VOCAB, repeat=0, rate_index=0, rate=1.0)
    assert first == bench.workload(args, VOCAB, repeat=0, rate_index=0, rate=1.0)
    assert len(first) == 24 and sum(item.long for item in first) == 3  # round(0.125 x 24), exactly
    for item in first:
        lo, hi = (2048, 4096) if item.long else (128, 256)
        assert lo <= len(item.prompt) <= hi and 64 <= item.max_tokens <= 128
        assert min(item.prompt) >= bench.FIRST_TOKEN and max(item.prompt) < VOCAB
    assert first[0].arrival_s == 0 and all(a.arrival_s <= b.arrival_s for a, b in zip(first, first[1:]))
    # Another rate: the same requests at another pace, with prompt tokens of their own (no prefix-cache hits).
    faster = bench.workload(args, VOCAB, repeat=0, rate_index=1, rate=4.0)
    assert [(len(a.prompt), a.max_tokens, a.long) for a in first] == [(len(b.prompt), b.max_tokens, b.long)
                                                                       for b in faster]
    assert [b.arrival_s for b in faster] == pytest.approx([a.arrival_s / 4 for a in first])
    assert all(a.prompt[:16] != b.prompt[:16] for a, b in zip(first, faster))
    # Another repeat: other kinds, lengths and gaps.
    other = bench.workload(args, VOCAB, repeat=1, rate_index=0, rate=1.0)
    assert [len(a.prompt) for a in first] != [len(b.prompt) for b in other]


def test_poisson_arrivals_have_the_asked_rate(bench):
    args = bench.parse_args(["--num-requests", "4000", "--long-share", "0"])
    items = bench.workload(args, 400, repeat=0, rate_index=0, rate=2.0)
    assert items[-1].arrival_s / (len(items) - 1) == pytest.approx(0.5, rel=0.05)


def test_slo_scales_ttft_with_the_prompt(report_module):
    slo = report_module.Slo(ttft_ms=2000, ttft_ms_per_token=2.5, tpot_ms=100)
    assert slo.ttft_limit_ms(256) == 2000 and slo.ttft_limit_ms(3000) == 7500
    Outcome = report_module.Outcome
    assert slo.meets_ttft(Outcome(3000, 64, True, ttft_ms=7400, tpot_ms=90))
    assert not slo.meets_ttft(Outcome(200, 64, False, ttft_ms=2100, tpot_ms=90))
    assert not slo.meets_tpot(Outcome(200, 64, False, ttft_ms=100, tpot_ms=101))
    failed = Outcome(200, 0, False, error="HTTP 503")
    assert not slo.meets_ttft(failed) and not slo.meets_tpot(failed)
    assert slo.scaled_ttft(2).ttft_limit_ms(3000) == 15000


def test_percentile_matches_numpy(report_module):
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert report_module.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert report_module.percentile([], 50) is None


def _run(report_module, outcomes, duration=10.0):
    return {"duration_s": duration, "outcomes": [asdict(o) for o in outcomes]}


def test_score_counts_requests_meeting_both(report_module):
    O, slo = report_module.Outcome, report_module.Slo(2000, 2.5, 100)
    run = _run(report_module, [O(200, 100, False, 500, 50), O(200, 100, False, 2500, 50),  # TTFT missed
                               O(3000, 100, True, 7000, 150), O(200, 0, False, error="boom")])  # TPOT missed, failed
    s = report_module.score_run(run, 2.0, slo)
    assert (s["attainment"], s["goodput"], s["ttft_attainment"], s["tpot_attainment"]) == (0.25, 0.5, 0.5, 0.5)
    assert s["failed"] == 1 and s["output_throughput"] == 30.0


def synthetic_report(report_module, tmp_path: Path) -> dict:
    """Two servers at two rates: `a` slow to first tokens on long prompts, `b` slow per token at the higher rate."""
    O = report_module.Outcome
    rng = random.Random(0)

    def runs(ttft_long, tpot):
        return [_run(report_module, [O(3000, 100, True, ttft_long + rng.uniform(0, 100), tpot) for _ in range(2)]
                     + [O(200, 100, False, 300 + rng.uniform(0, 100), tpot + rng.uniform(0, 5)) for _ in range(14)])
                for _ in range(3)]

    return {"command": "benchmarks/goodput.py", "date": "d", "machine": "m",
            "config": {"model": "tiny", "cpus": "0-1", "rates": ["1", "2"], "repeats": 3, "num_requests": 16,
                       "num_long": 2, "short_prompt": [128, 256], "long_prompt": [2048, 4096],
                       "output_len": [64, 128], "seed": 0, "sampling": "API default sampling", "kv_cache_gb": 2},
            "servers": {"unified": {"pinning": {}, "rates": {"1": runs(3000, 40), "2": runs(3000, 120)}},
                        "pd": {"pinning": {}, "rates": {"1": runs(9000, 30), "2": runs(9000, 35)}}}}


def test_analysis_and_its_sweeps(report_module, tmp_path):
    report = synthetic_report(report_module, tmp_path)
    summary = report_module.analyse(report, report_module.Slo(2000, 2.5, 100))
    cells = summary["cells"]
    assert cells["unified"]["1"]["attainment"] == 1.0 and cells["unified"]["2"]["tpot_attainment"] == 0.0
    assert cells["pd"]["2"]["goodput"] == pytest.approx(2 * 14 / 16)  # the long prompts miss TTFT
    assert summary["sustained_rate"] == {"unified": 1.0, "pd": None}  # pd: 87.5% at both rates
    assert summary["tpot_sweep"]["unified"]["2"]["150"] == 2.0 and summary["tpot_sweep"]["unified"]["2"]["100"] == 0
    assert summary["ttft_sweep"]["pd"]["2"]["0.5"] == pytest.approx(2 * 14 / 16)
    assert summary["ttft_sweep"]["pd"]["2"]["2"] == 2.0  # 15 s allowed at 3000 tokens
    assert cells["pd"]["1"]["latency"]["long"]["requests"] == 6
    lines = report_module.verdicts(summary, ["1", "2"])
    assert lines[0].startswith("- **1 req/s** - best: unified.") and "best: pd." in lines[1]


def test_rescore_writes_the_tables_under_new_slos(bench, report_module, tmp_path):
    past = tmp_path / "past.json"
    past.write_text(json.dumps(synthetic_report(report_module, tmp_path)))
    out = tmp_path / "out"
    assert bench.main(["--rescore", str(past), "--tpot-slo-ms", "150", "--ttft-slo-ms-per-token", "2.5",
                       "--out-dir", str(out)]) == 0
    text = (out / "goodput.md").read_text()
    assert "TTFT <= max(2 s, 2.5 ms x prompt tokens), TPOT <= 150 ms" in text
    assert "| 2 | 2.00 | 1.75 |" in text  # unified | pd goodput at 2 req/s
    assert json.loads((out / "goodput.json").read_text())["summary"]["slo"]["tpot_ms"] == 150
    assert (out / "goodput.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv", [["--rates", "inf"], ["--rates", "0"], ["--short-prompt", "300-200"],
                                  ["--long-share", "1.5"], ["--servers", "sglang"]])
def test_bad_arguments_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_quick_is_small_and_ours_only(bench):
    args = bench.parse_args(["--quick"])
    assert args.servers == ["unified", "pd"] and args.num_requests == 12 and bench.num_long(args) == 2
    assert args.rates == ["4", "12"] and args.long_prompt[1] + args.output_len[1] <= 2048
