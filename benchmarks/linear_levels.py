"""The CPU panel kernels (kernels/csrc/cpu_linear.cpp) at one prebuilt level against oneDNN held to the same
instructions: SmolLM2's linear layers at 1, 16 and 64 rows, float32 panels, and Q4_1 panels (two weights a
byte) beside them. An AVX-512 machine measures the AVX2 level this way, as an AVX2-only CPU would run it.

    .venv/bin/python benchmarks/linear_levels.py                 # the avx2 level, oneDNN capped at AVX2
    .venv/bin/python benchmarks/linear_levels.py --level avx512_bf16 --onednn-isa AVX512_CORE

Writes benchmarks/results/linear_levels_<level>.json; each cell is the median of 3 timings of a loop.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# (out_features, in_features): qkv, o, gate/up, down, lm_head
SHAPES = [(960, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)]


def timed(fn, seconds: float = 0.3) -> float:
    """Microseconds a call, median of 3 loops of about `seconds` each."""
    for _ in range(5):
        fn()
    start = time.perf_counter()
    fn()
    calls = max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))
    loops = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="avx2", help="a prebuilt level this CPU runs (kernels/cpu_levels.py)")
    p.add_argument("--onednn-isa", default="AVX2", help="ONEDNN_MAX_CPU_ISA for the oneDNN side")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ["ONEDNN_MAX_CPU_ISA"] = args.onednn_isa  # read when oneDNN first runs: before torch computes

    import torch

    from epdserve.kernels import cpu_build, cpu_levels

    torch.set_num_threads(args.threads)
    level = next(lv for lv in cpu_levels.LEVELS if lv.name == args.level)
    ops = cpu_build.load_prebuilt("cpu_linear", level)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        panels = ops.pack(w)
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
        scale, offset = torch.randn(n, k // 32, generator=gen) * 0.01, torch.randn(n, k // 32, generator=gen) * 0.1
        q4 = ops.pack_quantized(q, scale, offset, 0)
        for m in (1, 16, 64):
            x = torch.randn(m, k, generator=gen)
            cell = {"out_features": n, "in_features": k, "rows": m,
                    "onednn_us": timed(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")),
                    "float32_us": timed(lambda: ops.linear(x, panels, n, None)),
                    "q4_1_us": timed(lambda: ops.linear_quantized(x, q4, n, True, 0, None))}
            cell["float32_vs_onednn"] = cell["onednn_us"] / cell["float32_us"]
            rows.append(cell)
            print(f"{n:6d} x {k:5d}, {m:2d} rows: oneDNN {cell['onednn_us']:8.1f} us, panels float32 "
                  f"{cell['float32_us']:8.1f} us ({cell['float32_vs_onednn']:.2f}x), Q4_1 {cell['q4_1_us']:8.1f} us",
                  flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"linear_levels_{level.name}.json"
    out.write_text(json.dumps({"level": level.name, "onednn_isa": args.onednn_isa, "threads": args.threads,
                               "cells": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
