"""Check every Triton kernel against its PyTorch reference (kernels/torch_attention.py; F.linear on a dequantized
weight) on a CUDA GPU, then time it.

Attention is memory-bound in decode, so each case reports achieved bandwidth: the bytes it must move
at least (every K/V token a query can see read once, Q read, O written, block tables) over the median
kernel time, against the device-to-device copy bandwidth measured here (read + write of a large
buffer). Prefill cases also report TFLOP/s. The quantized linear cases (GGUF Q4_1 and Q8_0 weights) count the
weight's packed bytes, its scales and offsets, x read and y written. Before each timed call a 256 MiB buffer is zeroed: it
evicts the L2 cache and keeps the GPU busy while the next launch is queued, so launch overhead is not
timed.

    python benchmarks/kernels_gpu.py            # ~1-3 minutes; JSON to benchmarks/results/kernels_gpu.json
    python benchmarks/kernels_gpu.py --quick    # fewer cases and iterations

Exits 1 without a CUDA GPU, 2 if any kernel disagrees with its reference (after writing the JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "kernels_gpu.json"
FLUSH_BYTES = 256 << 20

# (num_heads, num_kv_heads, head_size) of two real models.
MODELS = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}
# Same tolerances as the CPU tests (tests/kernels), by dtype: (atol, rtol).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 1.6e-2)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class AttentionCase(NamedTuple):
    name: str
    model: str
    q_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # total tokens per sequence (cached prefix + new)
    sliding_window: int | None = None


class Result(NamedTuple):
    kernel: str
    case: str
    ms: float  # median kernel time
    gbps: float  # minimum bytes moved / time
    copy_frac: float  # gbps / measured copy bandwidth
    tflops: float | None  # attention math rate (prefill cases)
    max_err: float  # against the reference, on the checked part of the inputs
    ok: bool


# --- pure arithmetic (tested on CPU) -------------------------------------------------------------

def visible_keys(q_len: int, seq_len: int, sliding_window: int | None) -> int:
    """Sum over a sequence's new tokens of how many keys each attends to (causal, windowed)."""
    positions = torch.arange(seq_len - q_len, seq_len, dtype=torch.int64)
    counts = positions + 1 if sliding_window is None else (positions + 1).clamp(max=sliding_window)
    return int(counts.sum())


def attention_bytes(q_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                    head_size: int, elem_size: int, block_size: int,
                    sliding_window: int | None = None) -> int:
    """Least traffic of one paged attention call: each visible K/V token read once, Q read, O written."""
    kv_tokens = 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        first_visible = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        kv_tokens += seq_len - first_visible
    kv = 2 * kv_tokens * num_kv_heads * head_size * elem_size
    qo = 2 * sum(q_lens) * num_heads * head_size * elem_size
    tables = sum(-(-seq_len // block_size) for seq_len in seq_lens) * 4 + len(seq_lens) * 12
    return kv + qo + tables


def attention_flops(q_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int, head_size: int,
                    sliding_window: int | None = None) -> int:
    """Multiply-adds of QK^T and PV over the visible keys only, counted as 2 flops each."""
    keys = sum(visible_keys(q, s, sliding_window) for q, s in zip(q_lens, seq_lens))
    return 4 * keys * num_heads * head_size


def kv_write_bytes(num_tokens: int, num_kv_heads: int, head_size: int, elem_size: int) -> int:
    """K and V read once and written once, plus the int64 slot mapping."""
    return 4 * num_tokens * num_kv_heads * head_size * elem_size + 8 * num_tokens


def format_table(results: Sequence[Result], copy_gbps: float) -> str:
    header = ("kernel", "case", "ms", "GB/s", "% copy", "TFLOP/s", "max err", "check")
    rows = [header] + [
        (r.kernel, r.case, f"{r.ms:.4f}", f"{r.gbps:.0f}", f"{100 * r.copy_frac:.0f}",
         "-" if r.tflops is None else f"{r.tflops:.1f}", f"{r.max_err:.1e}", "ok" if r.ok else "FAIL")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"copy ceiling (device-to-device, read + write): {copy_gbps:.0f} GB/s")
    return "\n".join(lines)


# --- cases ---------------------------------------------------------------------------------------

def attention_cases(quick: bool) -> list[AttentionCase]:
    cases = []
    batches, contexts = ((64,), (1024, 8192)) if quick else ((64, 256), (1024, 4096, 8192))
    for model in MODELS:
        for batch in batches:
            for ctx in contexts:
                cases.append(AttentionCase(f"decode b={batch} ctx={ctx}", model, [1] * batch, [ctx] * batch))
    cases += [
        AttentionCase("prefill 8x1024", "smollm2-135m", [1024] * 8, [1024] * 8),
        AttentionCase("prefill 4x2048", "llama-8b", [2048] * 4, [2048] * 4),
        AttentionCase("chunked 8x512 on 4096", "llama-8b", [512] * 8, [4608] * 8),
        AttentionCase("mixed 64 decode + 2x512 chunks", "llama-8b", [1] * 64 + [512] * 2,
                      [4096] * 64 + [1024, 3072]),
        AttentionCase("decode b=64 ctx=8192 window=1024", "llama-8b", [1] * 64, [8192] * 64, 1024),
    ]
    return cases


# --- GPU side ------------------------------------------------------------------------------------

def time_cuda(fn: Callable[[], object], warmup: int, iters: int, flush: torch.Tensor) -> float:
    """Median milliseconds of fn() over `iters` calls, each after an L2-evicting buffer fill."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(warmup: int, iters: int, flush: torch.Tensor) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup, iters, flush)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def build_attention_inputs(case: AttentionCase, dtype: torch.dtype, block_size: int, gen: torch.Generator):
    num_heads, num_kv_heads, head_size = MODELS[case.model]
    blocks = [-(-n // block_size) for n in case.seq_lens]
    num_blocks = sum(blocks) + 1
    # Shuffled block ids, as a long-running block pool hands them out.
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    offset = 0
    for s, n in enumerate(blocks):
        block_tables[s, :n] = perm[offset:offset + n]
        offset += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    query = torch.randn(sum(case.q_lens), num_heads, head_size, device="cuda", dtype=dtype, generator=gen)
    q_lens = torch.tensor(case.q_lens, dtype=torch.int32, device="cuda")
    query_start_loc = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc


def bench_attention(case, dtype, block_size, args, flush, copy_gbps, gen) -> Result:
    from epdserve.kernels import torch_attention
    from epdserve.kernels.paged_attention import paged_attention

    num_heads, num_kv_heads, head_size = MODELS[case.model]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = build_attention_inputs(
        case, dtype, block_size, gen)
    scale = head_size ** -0.5
    out = torch.empty_like(query)

    # Check on the first few sequences (the reference gathers K/V in float32, too big for whole batches),
    # including the last one so mixed batches check their prefill chunks.
    picks = sorted({0, 1, len(case.seq_lens) - 1} & set(range(len(case.seq_lens))))
    starts = query_start_loc.tolist()
    rows = torch.cat([torch.arange(starts[s], starts[s + 1], device="cuda") for s in picks])
    sub_qsl = torch.tensor([0] + [case.q_lens[s] for s in picks], device="cuda").cumsum(0).to(torch.int32)
    sub = (query[rows], key_cache, value_cache, block_tables[picks], seq_lens[picks], sub_qsl, scale,
           case.sliding_window)
    got = paged_attention(*sub)
    want = torch_attention.paged_attention(*sub)
    max_err = (got.float() - want.float()).abs().max().item()
    atol, rtol = TOLERANCES[dtype]
    ok = bool(torch.isclose(got.float(), want.float(), atol=atol, rtol=rtol).all())

    ms = time_cuda(lambda: paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                           query_start_loc, scale, case.sliding_window, out),
                   args.warmup, args.iters, flush)
    nbytes = attention_bytes(case.q_lens, case.seq_lens, num_heads, num_kv_heads, head_size,
                             query.element_size(), block_size, case.sliding_window)
    gbps = nbytes / (ms * 1e-3) / 1e9
    tflops = None
    if max(case.q_lens) > 1:
        flops = attention_flops(case.q_lens, case.seq_lens, num_heads, head_size, case.sliding_window)
        tflops = flops / (ms * 1e-3) / 1e12
    return Result("paged_attention", f"{case.model} {case.name}", ms, gbps, gbps / copy_gbps, tflops, max_err, ok)


def bench_kv_write(model, num_tokens, dtype, block_size, args, flush, copy_gbps, gen) -> Result:
    from epdserve.kernels import torch_attention
    from epdserve.kernels.kv_cache_write import kv_cache_write

    _, num_kv_heads, head_size = MODELS[model]
    num_blocks = 2 * -(-num_tokens // block_size)
    key = torch.randn(num_tokens, num_kv_heads, head_size, device="cuda", dtype=dtype, generator=gen)
    value = torch.randn_like(key)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.zeros(shape, device="cuda", dtype=dtype)
    value_cache = torch.zeros(shape, device="cuda", dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens]

    want_k, want_v = key_cache.clone(), value_cache.clone()
    torch_attention.kv_cache_write(key, value, want_k, want_v, slots)
    kv_cache_write(key, value, key_cache, value_cache, slots)
    ok = torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    max_err = max((key_cache.float() - want_k.float()).abs().max().item(),
                  (value_cache.float() - want_v.float()).abs().max().item())

    ms = time_cuda(lambda: kv_cache_write(key, value, key_cache, value_cache, slots), args.warmup, args.iters, flush)
    gbps = kv_write_bytes(num_tokens, num_kv_heads, head_size, key.element_size()) / (ms * 1e-3) / 1e9
    return Result("kv_cache_write", f"{model} tokens={num_tokens}", ms, gbps, gbps / copy_gbps, None, max_err, ok)


# (out_features, in_features) of SmolLM2's gate/up projection and of a Llama-8B one.
LINEAR_SHAPES = {"smollm2-135m": (1536, 576), "llama-8b": (14336, 4096)}
# GGUF layouts (kernels/quantized_linear.py): (q range, group, with offset).
QUANT_FORMATS = {"q4_1": ((0, 16), 32, True), "q8_0": ((-127, 128), 32, False)}


def bench_quantized_linear(model, fmt, rows, dtype, args, flush, copy_gbps, gen) -> Result:
    """The Triton quantized linear on a random weight of `fmt`: checked against F.linear on the dequantized
    weight (bit for bit on one-hot rows: the dequantized values themselves), its bandwidth counted on the bytes it
    must read (q, scales, offsets, x) and write (y)."""
    import torch.nn.functional as F

    from epdserve.kernels import quantized_linear
    from epdserve.shared.models.quantized_weight import QuantizedWeight

    n, k = LINEAR_SHAPES[model]
    (low, high), group, with_offset = QUANT_FORMATS[fmt]
    q = torch.randint(low, high, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    scale = torch.randn(n, k // group, device="cuda", generator=gen) * 0.01
    offset = torch.randn(n, k // group, device="cuda", generator=gen) * 0.1 if with_offset else None
    w = QuantizedWeight(q, scale, offset).dequantize()
    tiles = quantized_linear.pack(q, scale, offset)
    eye = torch.eye(k, device="cuda")[:min(k, 512)]
    exact = torch.equal(quantized_linear.linear(eye, tiles), w[:, :eye.shape[0]].t())
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    got, want = quantized_linear.linear(x, tiles).float(), F.linear(x.float(), w.to(dtype).float())
    max_err = (got - want).abs().max().item()
    atol, rtol = TOLERANCES[dtype]
    ok = exact and torch.allclose(got, want, atol=atol * k ** 0.5, rtol=rtol)
    ms = time_cuda(lambda: quantized_linear.linear(x, tiles), args.warmup, args.iters, flush)
    moved = sum(t.numel() * t.element_size() for t in tiles if isinstance(t, torch.Tensor)) + \
        x.numel() * x.element_size() + rows * n * x.element_size()
    gbps = moved / (ms * 1e-3) / 1e9
    tflops = 2 * rows * n * k / (ms * 1e-3) / 1e12
    return Result("quantized_linear", f"{model} {fmt} rows={rows}", ms, gbps, gbps / copy_gbps, tflops, max_err, ok)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and iterations")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per case (default 10, quick 3)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case (default 100, quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH, help="JSON results file")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.iters = args.iters if args.iters is not None else (20 if args.quick else 100)
    if args.block_size < 1 or args.warmup < 0 or args.iters < 1:
        parser.error("--block-size and --iters must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA GPU found; this benchmark needs one (the CPU tests are in tests/kernels)",
              file=sys.stderr)
        return 1
    import triton

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    began = time.perf_counter()
    copy_gbps = copy_bandwidth(args.warmup, args.iters, flush)

    results = []
    for case in attention_cases(args.quick):
        results.append(bench_attention(case, dtype, args.block_size, args, flush, copy_gbps, gen))
        print(f"  {results[-1].case}: {results[-1].ms:.4f} ms", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    for model in MODELS:
        for num_tokens in (256, 16384):
            results.append(bench_kv_write(model, num_tokens, dtype, args.block_size, args, flush, copy_gbps, gen))
    for model in LINEAR_SHAPES:
        for fmt in QUANT_FORMATS:
            for rows in (1, 16) if args.quick else (1, 16, 256):
                results.append(bench_quantized_linear(model, fmt, rows, dtype, args, flush, copy_gbps, gen))

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "warmup": args.warmup,
        "iters": args.iters,
        "copy_gbps": copy_gbps,
        "seconds": time.perf_counter() - began,
        "results": [r._asdict() for r in results],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}, {args.dtype}, block size {args.block_size}; wrote {args.output}")
    print(format_table(results, copy_gbps))
    return 0 if all(r.ok for r in results) else 2


if __name__ == "__main__":
    sys.exit(main())
