"""`epdserve plan`'s predictions against measured runs: for each traffic mix, every layout the plan weighs on this
machine is started and sent that traffic, and its measured TTFT and TPOT (mean and p50) and goodput stand beside
the predicted ones.

The profile is measured once, at the start (`epdserve plan --save-profile`, one thread per engine, the
engine options of --engine-args), and each mix is planned from it (`epdserve plan --profile`, --max-instances
instances of one thread each: one per core). Each layout runs as `epdserve up` with the same engine options,
one thread per engine, each engine pinned to a core of its own (--cpus; the proxy on all of them). A mix is
--num-requests streamed completions of random token ids, EOS ignored, greedy, their arrivals a Poisson process
at the mix's rate, seeded: the same requests for every layout.

Each latency is predicted as a mean and as a median (p50), each set beside the measured one of its kind.
Goodput = rate x the share of requests meeting both SLOs; the predicted goodput is the highest rate at which the
predicted means meet them. The plan's choice is right when the layout it recommends has the highest measured
goodput of those weighed, or meets both SLOs at the p50 with the fewest instances.

Writes benchmarks/results/plan_check.{json,md,png} (predicted against measured TTFT and TPOT).

    .venv/bin/python benchmarks/plan_check.py                 # SmolLM2, three mixes, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/plan_check.py --mixes 0.5:128:64 --num-requests 20 --repeats 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import Item, run_workload  # noqa: E402
from goodput_report import outcomes_of, percentile  # noqa: E402
from stacks import ROOT, Stack, cpu_list, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIRST_TOKEN = 300  # prompt token ids are drawn from [FIRST_TOKEN, vocab): no special tokens


def mix(value: str) -> tuple[float, int, int]:
    rate, input_len, output_len = value.split(":")
    return float(rate), int(input_len), int(output_len)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--mixes", type=lambda v: [mix(m) for m in v.split(",")],
                   default=[(0.5, 128, 64), (1.2, 128, 64), (0.3, 512, 32)],
                   help="RATE:INPUT_LEN:OUTPUT_LEN,... (default: 0.5:128:64,1.2:128:64,0.3:512:32)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default: %(default)s)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds (default: %(default)s)")
    p.add_argument("--cpus", default="0-1")
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1, help="runs of each (mix, layout); medians")
    p.add_argument("--engine-args", default="--num-kv-blocks 2048", help="options of every engine, and the profile's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    if args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model
        args.model = str(prepare_default_model())
    return args


def epdserve(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "epdserve.services.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"epdserve {' '.join(args[:1])} failed:\n{done.stderr[-3000:]}")
    return done


def items(args: argparse.Namespace, vocab: int, rate: float, input_len: int, output_len: int, repeat: int) -> list[Item]:
    rng = random.Random(f"plan/{args.seed}/{rate}/{input_len}/{output_len}/{repeat}")
    arrivals = [0.0, *accumulate(rng.expovariate(rate) for _ in range(args.num_requests - 1))]
    return [Item(at, [rng.randrange(FIRST_TOKEN, vocab) for _ in range(input_len)], output_len, False)
            for at in arrivals]


def measured(runs: list[dict], rate: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Means and medians of every run's requests pooled; goodput the median of the runs'."""
    outcomes = [o for run in runs for o in outcomes_of(run) if o.error is None]
    ttft, tpot = [o.ttft_ms / 1e3 for o in outcomes], [o.tpot_ms / 1e3 for o in outcomes]
    goodputs = []
    for run in runs:
        done = outcomes_of(run)
        both = sum(o.error is None and o.ttft_ms / 1e3 <= ttft_slo and o.tpot_ms / 1e3 <= tpot_slo for o in done)
        goodputs.append(rate * both / len(done))
    return {"ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 50),
            "tpot_mean": statistics.fmean(tpot), "tpot_p50": percentile(tpot, 50),
            "goodput": statistics.median(goodputs), "failed": sum(o.error is not None for run in runs
                                                                  for o in outcomes_of(run))}


def run_layout(args, layout: dict, mix_items: list[list[Item]], log_dir: Path) -> list[dict]:
    cpus = cpu_list(args.cpus)
    counts = layout["counts"]
    up = ["--threads", "1"]
    if counts["unified"]:
        up += ["--unified", "--encoders", str(counts["encoders"])]
        pinning = {"unified": cpus[0], "proxy": args.cpus}
    else:
        up += ["--encoders", str(counts["encoders"]), "--prefills", str(counts["prefills"]),
               "--decodes", str(counts["decodes"])]
        pinning = {"prefill": cpus[0], "decode": cpus[-1], "proxy": args.cpus}
    stack = Stack(layout["layout"], args.model, up, shlex.split(args.engine_args), pinning, log_dir)
    stack.start(args.startup_timeout)
    try:
        warm = [Item(0.0, items_[0].prompt[:16], 4, False) for items_ in mix_items[:1]]
        asyncio.run(run_workload(stack.url, warm, 0.0))
        return [asyncio.run(run_workload(stack.url, run_items, 0.0)) for run_items in mix_items]
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    profile = work / "profile.json"
    max_instances = len(cpu_list(args.cpus))
    longest = max(m[1] for m in args.mixes)
    print(f"profiling {Path(args.model).name} (one thread)", flush=True)
    epdserve("plan", "--model", args.model, "--threads", "1", "--request-rate", "1", "--input-len", str(longest),
             "--output-len", "16", "--ttft-slo", "1", "--tpot-slo", "1", "--prompt-lens",
             ",".join(str(m[1]) for m in args.mixes) + ",16", "--batches", "1,2,4,8,16",
             "--save-profile", str(profile), *shlex.split(args.engine_args))
    report = {"what": "epdserve plan's predictions against measured runs", "machine": machine(),
              "date": datetime.now().isoformat(timespec="seconds"), "model": Path(args.model).name,
              "slo": {"ttft": args.ttft_slo, "tpot": args.tpot_slo}, "num_requests": args.num_requests,
              "repeats": args.repeats, "engine_args": args.engine_args,
              "profile": json.loads(profile.read_text()), "mixes": []}
    for rate, input_len, output_len in args.mixes:
        planned = work / "plan.json"
        printed = epdserve("plan", "--profile", str(profile), "--request-rate", str(rate), "--input-len",
                           str(input_len), "--output-len", str(output_len), "--ttft-slo", str(args.ttft_slo),
                           "--tpot-slo", str(args.tpot_slo), "--max-instances", str(max_instances),
                           "--output", str(planned)).stdout
        print(printed, flush=True)
        layouts = json.loads(planned.read_text())["layouts"]
        runs = [items(args, vocab, rate, input_len, output_len, r) for r in range(args.repeats)]
        rows = []
        for layout in layouts:
            got = measured(run_layout(args, layout, runs, work), rate, args.ttft_slo, args.tpot_slo)
            rows.append({"layout": layout["layout"], "counts": layout["counts"], "recommended": layout is layouts[0],
                         "predicted": {key: layout[key] for key in ("ttft", "tpot", "ttft_p50", "tpot_p50",
                                                                    "goodput", "meets_slo")},
                         "measured": got})
            print(f"  {layout['layout']:<8} predicted TTFT mean {layout['ttft']:.3f} p50 {layout['ttft_p50']:.3f} s, "
                  f"TPOT mean {layout['tpot'] * 1e3:.1f} p50 {layout['tpot_p50'] * 1e3:.1f} ms; "
                  f"measured TTFT mean {got['ttft_mean']:.3f} p50 {got['ttft_p50']:.3f} s, TPOT mean "
                  f"{got['tpot_mean'] * 1e3:.1f} p50 {got['tpot_p50'] * 1e3:.1f} ms, goodput {got['goodput']:.2f} "
                  f"req/s ({got['failed']} failed)", flush=True)
        report["mixes"].append({"rate": rate, "input_len": input_len, "output_len": output_len, "layouts": rows})
    write(report, out_dir)
    return 0


def ratio(predicted: float, measured: float) -> str:
    return "-" if not measured or predicted == float("inf") else f"{predicted / measured:.2f}"


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_check.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# `epdserve plan`: predicted against measured", "",
             f"{report['date']}, {report['machine']}; {report['model']}, one thread per engine, engine options "
             f"`{report['engine_args']}`; {report['num_requests']} requests per run x {report['repeats']}; SLOs "
             f"TTFT <= {report['slo']['ttft']} s, TPOT <= {report['slo']['tpot'] * 1e3:g} ms. Each cell: predicted / "
             f"measured (their ratio); TTFT in seconds, TPOT in ms.", "",
             "| mix (req/s, in/out) | layout | TTFT p50 | TTFT mean | TPOT p50 | TPOT mean | goodput pred (max rate) "
             "| goodput measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]

    def cell(row: dict, key: str, scale: float, digits: int) -> str:
        measured_key = key if key.endswith("_p50") else key + "_mean"
        predicted, measured = row["predicted"][key], row["measured"][measured_key]
        return f"{predicted * scale:.{digits}f} / {measured * scale:.{digits}f} ({ratio(predicted, measured)})"

    for m in report["mixes"]:
        for row in m["layouts"]:
            name = row["layout"] + (" (recommended)" if row["recommended"] else "")
            lines.append(f"| {m['rate']:g}, {m['input_len']}/{m['output_len']} | {name} | "
                         f"{cell(row, 'ttft_p50', 1, 3)} | {cell(row, 'ttft', 1, 3)} | {cell(row, 'tpot_p50', 1e3, 1)} | "
                         f"{cell(row, 'tpot', 1e3, 1)} | {row['predicted']['goodput']:.2f} | "
                         f"{row['measured']['goodput']:.2f} |")
    (out_dir / "plan_check.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, unit, scale in ((axes[0], "ttft", "s", 1), (axes[1], "tpot", "ms", 1e3)):
        points = [(row["predicted"][f"{key}_p50"] * scale, row["measured"][f"{key}_p50"] * scale, row["layout"])
                  for m in report["mixes"] for row in m["layouts"] if row["predicted"][f"{key}_p50"] != float("inf")]
        for pred, meas, name in points:
            ax.scatter(meas, pred)
            ax.annotate(name, (meas, pred), fontsize=7)
        top = max([max(p, q) for p, q, _ in points] + [1e-9]) * 1.1
        ax.plot([0, top], [0, top], "k--", linewidth=0.8)
        ax.fill_between([0, top], [0, top * 0.75], [0, top * 1.25], alpha=0.1)
        ax.set_xlabel(f"measured p50 {key.upper()} ({unit})")
        ax.set_ylabel(f"predicted p50 {key.upper()} ({unit})")
    fig.tight_layout()
    fig.savefig(out_dir / "plan_check.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
