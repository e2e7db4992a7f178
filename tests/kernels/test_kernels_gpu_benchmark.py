"""The GPU kernel benchmark script: its CPU-side parts (arguments, byte/flop arithmetic, table)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kernels_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--output" in result.stdout


def test_arguments(bench):
    args = bench.parse_args(["--quick"])
    assert (args.warmup, args.iters, args.dtype, args.output) == (3, 20, "bfloat16", bench.RESULTS_PATH)
    assert bench.parse_args(["--iters", "7"]).iters == 7
    with pytest.raises(SystemExit):
        bench.parse_args(["--iters", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_exits_clearly_without_gpu(bench, capsys, tmp_path):
    assert bench.main(["--output", str(tmp_path / "r.json")]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_decode_bytes(bench):
    # 2 sequences of 10 and 33 tokens, 1 new token each; 4 heads over 2 KV heads of 8, float16, blocks of 16.
    kv = 2 * (10 + 33) * 2 * 8 * 2
    qo = 2 * 2 * 4 * 8 * 2
    tables = (1 + 3) * 4 + 2 * 12
    assert bench.attention_bytes([1, 1], [10, 33], 4, 2, 8, 2, 16) == kv + qo + tables


def test_window_limits_bytes_and_flops(bench):
    # One decode token at position 9 with a window of 4 sees keys 6..9.
    full = bench.attention_bytes([1], [10], 1, 1, 8, 4, 16)
    windowed = bench.attention_bytes([1], [10], 1, 1, 8, 4, 16, sliding_window=4)
    assert full - windowed == 2 * 6 * 8 * 4
    assert bench.visible_keys(1, 10, 4) == 4
    # A prefill chunk of 3 tokens after 2 cached ones, window 3: keys seen 3, 3, 3.
    assert bench.visible_keys(3, 5, 3) == 9
    assert bench.visible_keys(3, 5, None) == 3 + 4 + 5


def test_prefill_flops(bench):
    # Causal prefill of 3 tokens sees 1 + 2 + 3 keys; QK^T and PV are 2 flops per multiply-add each.
    assert bench.attention_flops([3], [3], num_heads=2, head_size=8) == 4 * 6 * 2 * 8


def test_kv_write_bytes(bench):
    assert bench.kv_write_bytes(5, 2, 8, 2) == 4 * 5 * 2 * 8 * 2 + 8 * 5


def test_cases_are_valid(bench):
    for quick in (True, False):
        cases = bench.attention_cases(quick)
        assert cases and len({c.name + c.model for c in cases}) == len(cases)
        for case in cases:
            assert case.model in bench.MODELS and len(case.q_lens) == len(case.seq_lens)
            assert all(0 < q <= s for q, s in zip(case.q_lens, case.seq_lens))


def test_table(bench):
    results = [
        bench.Result("paged_attention", "llama-8b decode b=64 ctx=1024", 0.1234, 3900.4, 0.82, None, 1e-3, True),
        bench.Result("paged_attention", "llama-8b prefill 4x2048", 1.5, 200.0, 0.04, 250.3, 2e-2, False),
    ]
    lines = bench.format_table(results, 4750.0).splitlines()
    assert lines[0].split() == ["kernel", "case", "ms", "GB/s", "%", "copy", "TFLOP/s", "max", "err", "check"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split()[-6:] == ["0.1234", "3900", "82", "-", "1.0e-03", "ok"]
    assert lines[3].split()[-6:] == ["1.5000", "200", "4", "250.3", "2.0e-02", "FAIL"]
    assert len({len(line) for line in lines[:4]}) == 1, "columns are not aligned"
    assert lines[-1].endswith("4750 GB/s")


@pytest.mark.gpu
def test_quick_run_on_gpu(bench, tmp_path):
    output = tmp_path / "kernels_gpu.json"
    assert bench.main(["--quick", "--iters", "3", "--warmup", "1", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["copy_gbps"] > 0 and all(r["ok"] for r in report["results"])
