"""The sampler alone: this tree's shared/engine/sampler.py against an earlier one loaded from git.

One call samples a decode batch: [64, 49152] float32 logits (SmolLM2's vocabulary, randn * 3), one
row per request, in these settings:
  temperature   temperature 1.0, no filters, unseeded
  top_p 0.9     temperature 1.0, top_p 0.9
  top_k 50      temperature 1.0, top_k 50
  seeded        temperature 1.0, every request with its own seed
  penalties     temperature 1.0, repetition 1.2, frequency 0.5, presence 0.5, 256 prior tokens each
  greedy        temperature 0

The baseline is, by default, shared/engine/sampler.py as it was just before the commit that removed its
per-row exponential race (`--baseline REV` picks another). Old and new calls alternate, so that load from
elsewhere on the machine hits both alike; the median of --repeats calls is reported, at each thread
count. For scale, the time of one batch-64 decode step of SmolLM2-135M is measured too when the model
is prepared (`epdserve model smollm2`; `--no-model` skips it).

    python benchmarks/sampler_bench.py                  # table on stdout, JSON in results/sampler_bench.json
    python benchmarks/sampler_bench.py --threads 1 --repeats 5 --no-model
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampler import Sampler
from epdserve.shared.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SAMPLER_PATH = "shared/engine/sampler.py"
OLD_SAMPLER_PATH = "shared/sampler.py"
CASES = {
    "temperature": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "seeded": dict(temperature=1.0),  # seeds added per request
    "penalties": dict(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    "greedy": dict(temperature=0.0),
}
PRIOR_TOKENS = 256  # half prompt, half output


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def default_baseline() -> str:
    # The parent of the latest commit that added or removed the per-row exponential race.
    # The sampler lived at shared/sampler.py then; git finds it under that path.
    commit = git("log", "-n1", "--format=%H", "-S", "noise[j].exponential_", "--", OLD_SAMPLER_PATH)
    if not commit:
        raise SystemExit("no commit touches the exponential race in shared/engine/sampler.py: pass --baseline")
    return f"{commit}^"


def sampler_path_at(rev: str) -> str:
    """Where the sampler's file was at git revision rev (it moved into shared/engine/)."""
    listed = git("ls-tree", "--name-only", rev, "--", SAMPLER_PATH)
    return SAMPLER_PATH if listed else OLD_SAMPLER_PATH


def load_sampler_at(rev: str, tmp: Path):
    """The Sampler class of shared/engine/sampler.py at git revision rev."""
    path = tmp / "sampler_baseline.py"
    path.write_text(git("show", f"{rev}:{sampler_path_at(rev)}"))
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler


def make_requests(case: str, batch: int, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    requests = []
    for i in range(batch):
        params = SamplingParams(**CASES[case], seed=i if case == "seeded" else None)
        prompt = torch.randint(vocab, (PRIOR_TOKENS // 2,), generator=g).tolist()
        r = Request(f"r{i}", prompt, params, max_model_len=4 * PRIOR_TOKENS)
        for t in torch.randint(vocab, (PRIOR_TOKENS - len(prompt),), generator=g).tolist():
            r.append_output_token(t)
        requests.append(r)
    return requests


def time_samplers(samplers: dict, logits: torch.Tensor, requests: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each sampler, calls interleaved round by round."""
    times = {name: [] for name in samplers}
    names = list(samplers)
    with torch.inference_mode():
        for name in names:  # warm-up
            samplers[name](logits, requests[name])
        for i in range(repeats):
            for name in names[i % 2:] + names[:i % 2]:
                start = time.perf_counter()
                samplers[name](logits, requests[name])
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def decode_step_ms(model: Path, threads: list[int], batch: int) -> dict[int, float]:
    """Median time of a batch-wide decode step (model forward plus this tree's sampler) per thread count."""
    from epdserve.shared.engine.llm import LLM

    llm = LLM(str(model), max_num_seqs=batch)
    runner = llm.engine.runner
    steps: list[float] = []
    execute = runner.execute

    def timed(scheduled, *args, **kwargs):
        start = time.perf_counter()
        out = execute(scheduled, *args, **kwargs)
        if len(scheduled) == batch and all(num_new == 1 for _, num_new in scheduled):
            steps.append(time.perf_counter() - start)
        return out

    runner.execute = timed
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(1000, 20000, (32,), generator=g).tolist()} for _ in range(batch)]
    result = {}
    for n in threads:
        torch.set_num_threads(n)
        steps.clear()
        llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
        result[n] = statistics.median(steps) * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="git revision of the old sampler (default: before the exponential race went)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--no-model", action="store_true", help="skip the decode step of the real model")
    p.add_argument("--out", type=Path, default=RESULTS / "sampler_bench.json")
    args = p.parse_args(argv)

    baseline = args.baseline or default_baseline()
    baseline_commit = git("rev-parse", "--short", baseline)
    with tempfile.TemporaryDirectory() as tmp:
        OldSampler = load_sampler_at(baseline, Path(tmp))
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for case in args.cases:
            samplers = {"old": OldSampler(seed=0), "new": Sampler(seed=0)}
            requests = {name: make_requests(case, args.batch, args.vocab) for name in samplers}
            ms = time_samplers(samplers, logits, requests, args.repeats)
            rows.append(dict(case=case, threads=threads, old_ms=round(ms["old"], 3), new_ms=round(ms["new"], 3),
                             speedup=round(ms["old"] / ms["new"], 2)))
            r = rows[-1]
            print(f"{case:<12} threads {threads}  old {r['old_ms']:8.2f} ms  new {r['new_ms']:7.2f} ms  "
                  f"x{r['speedup']:.1f}", flush=True)

    step = {}
    model = Path.home() / ".cache" / "epdserve" / "models" / "SmolLM2-135M-Instruct"
    if not args.no_model and (model / "config.json").exists():
        step = decode_step_ms(model, args.threads, args.batch)

    print(f"\nsampler, [{args.batch}, {args.vocab}] float32 logits, median of {args.repeats} calls; "
          f"old = shared/engine/sampler.py at {baseline_commit}")
    print(f"| case | threads | old ms | new ms | old/new |{' new / decode step |' if step else ''}")
    print(f"|---|---|---|---|---|{'---|' if step else ''}")
    for r in rows:
        share = f" {100 * r['new_ms'] / step[r['threads']]:.1f}% |" if r["threads"] in step else ""
        print(f"| {r['case']} | {r['threads']} | {r['old_ms']:.2f} | {r['new_ms']:.2f} | {r['speedup']:.1f} |{share}")
    for threads, ms in step.items():
        print(f"decode step, SmolLM2-135M, batch {args.batch}, {threads} thread(s): {ms:.1f} ms")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "baseline": baseline_commit, "head": git("rev-parse", "--short", "HEAD"), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "batch": args.batch, "vocab": args.vocab,
        "repeats": args.repeats, "results": rows,
        "decode_step_ms": {str(k): round(v, 1) for k, v in step.items()},
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
