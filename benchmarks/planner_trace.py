"""`epdserve up --planner` through a load that rises and falls, beside a fixed layout under the same requests.

The trace: --phases RATE:SECONDS,... of Poisson arrivals (default 0.5 req/s for two minutes, then 1.5, 3, 1.5,
0.5: ten minutes, one decode overloaded at the peak), each request a streamed greedy completion of --input-len random token ids writing --output-len tokens
(EOS ignored), seeded: the same requests, at the same times, for both runs. The planner run is `epdserve up
--planner` within --bounds, planning from a profile measured first (`epdserve plan --save-profile`, one thread per
engine); the fixed run is `epdserve up` with --fixed's counts. One thread per engine in both; no pinning (the
planner's new instances share the cores with the rest).

Every 2 s the stack's /ready and /metrics give the instances each role has ready and what the planner wants.
Per request: TTFT, TPOT, whether it met both SLOs, its token ids. Reported: the instances over time, the SLO
attainment per 30-second window of each run (a plot), goodput, and how many streams completed with token ids
identical to the fixed layout's (greedy: a stream the planner's scale-in cut or changed would differ).

Writes benchmarks/results/planner_trace.{json,md,png}.

    .venv/bin/python benchmarks/planner_trace.py                 # ~22 minutes on 2 cores
    .venv/bin/python benchmarks/planner_trace.py --phases 0.5:20,1.5:20,0.3:20 --profile p.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stacks import ROOT, Stack, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIRST_TOKEN = 300
WINDOW_S = 30.0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--phases", default="0.5:120,1.5:120,3:120,1.5:120,0.5:120",
                   type=lambda v: [(float(r), float(s)) for r, s in (x.split(":") for x in v.split(","))])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--bounds", default="decode=1:2,prefill=1:2")
    p.add_argument("--fixed", default="1:1", help="PREFILLS:DECODES of the fixed run (default: %(default)s)")
    p.add_argument("--interval", type=float, default=5.0, help="the planner's --planner-interval")
    p.add_argument("--profile", help="a saved profile (default: measured first)")
    p.add_argument("--engine-args", default="--num-kv-blocks 2048")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    if args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model
        args.model = str(prepare_default_model())
    return args


def requests(args, vocab: int) -> list[tuple[float, list[int]]]:
    rng = random.Random(f"planner-trace/{args.seed}")
    out, start = [], 0.0
    for rate, seconds in args.phases:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            out.append((t, [rng.randrange(FIRST_TOKEN, vocab) for _ in range(args.input_len)]))
            t += rng.expovariate(rate)
        start += seconds
    return out


async def send(client, url, model, at, prompt, args, t0):
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    sent, first, tokens, error = time.perf_counter(), None, [], None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        error = str(chunk["error"])[:200]
                        break
                    if chunk.get("choices"):
                        first = first or time.perf_counter()
                        tokens += chunk["choices"][0]["logprobs"]["tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    done = error is None and len(tokens) == args.output_len
    ttft = first - sent if first else None
    tpot = (end - first) / max(len(tokens) - 1, 1) if first else None
    return {"at": at, "ttft": ttft, "tpot": tpot, "tokens": tokens, "error": error, "completed": done,
            "met": done and ttft <= args.ttft_slo and tpot <= args.tpot_slo}


def watch(url: str, timeline: list, stop: threading.Event, t0: float) -> None:
    while not stop.wait(2.0):
        try:
            ready = httpx.get(url + "/ready", timeout=5).json().get("healthy_instances", {})
            text = httpx.get(url + "/metrics", timeout=5).text
            desired = {s.labels["role"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "epdserve:planner_desired_replicas"}
        except (httpx.HTTPError, ValueError):
            continue
        timeline.append({"t": time.perf_counter() - t0, "ready": ready, "desired": desired})


def run(name: str, up_args: list[str], args, reqs, work: Path) -> dict:
    stack = Stack(name, args.model, ["--threads", "1", *up_args], args.engine_args.split(), {}, work)
    stack.start(600)
    timeline, stop = [], threading.Event()
    try:
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]

        async def main():
            limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                t0 = time.perf_counter()
                threading.Thread(target=watch, args=(stack.url, timeline, stop, t0), daemon=True).start()
                return await asyncio.gather(*(send(client, stack.url, model, at, p, args, t0) for at, p in reqs))

        results = asyncio.run(main())
    finally:
        stop.set()
        stack.stop()
    log = stack.tail(200_000)
    return {"name": name, "up_args": up_args, "results": results, "timeline": timeline,
            "decisions": [line for line in log.splitlines() if "planner:" in line]}


def windows(results: list[dict], total: float) -> list[tuple[float, float | None]]:
    out, t = [], 0.0
    while t < total:
        inside = [r for r in results if t <= r["at"] < t + WINDOW_S]
        out.append((t + WINDOW_S / 2, sum(r["met"] for r in inside) / len(inside) if inside else None))
        t += WINDOW_S
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="planner-trace-"))
    profile = args.profile
    if profile is None:
        profile = str(work / "profile.json")
        print("profiling (one thread)", flush=True)
        subprocess.run([sys.executable, "-m", "epdserve.services.cli", "plan", "--model", args.model, "--threads", "1",
                        "--request-rate", "1", "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo),
                        "--batches", "1,2,4,8,16", "--save-profile", profile, *args.engine_args.split()],
                       check=True, capture_output=True)
    reqs = requests(args, vocab)
    total = sum(s for _, s in args.phases)
    print(f"{len(reqs)} requests over {total:.0f} s", flush=True)
    prefills, decodes = args.fixed.split(":")
    runs = [run("planner", ["--planner", "--planner-bounds", args.bounds, "--planner-interval", str(args.interval),
                            "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo), "--planner-profile",
                            profile], args, reqs, work),
            run("fixed", ["--prefills", prefills, "--decodes", decodes], args, reqs, work)]
    report = {"what": "epdserve up --planner under a load rising and falling, beside a fixed layout",
              "machine": machine(), "date": datetime.now().isoformat(timespec="seconds"),
              "model": Path(args.model).name, "phases": args.phases, "input_len": args.input_len,
              "output_len": args.output_len, "slo": {"ttft": args.ttft_slo, "tpot": args.tpot_slo},
              "bounds": args.bounds, "fixed": args.fixed, "interval": args.interval, "runs": {}}
    fixed_tokens = [r["tokens"] for r in runs[1]["results"]]
    for r in runs:
        res = r["results"]
        report["runs"][r["name"]] = {
            "requests": len(res), "completed": sum(x["completed"] for x in res),
            "identical_to_fixed": sum(x["completed"] and x["tokens"] == f for x, f in zip(res, fixed_tokens)),
            "attainment": sum(x["met"] for x in res) / len(res), "goodput": sum(x["met"] for x in res) / total,
            "windows": windows(res, total), "timeline": r["timeline"], "decisions": r["decisions"],
            "errors": [x["error"] for x in res if x["error"]][:5],
            "results": [{k: v for k, v in x.items() if k != "tokens"} for x in res]}
        s = report["runs"][r["name"]]
        print(f"{r['name']}: {s['completed']}/{s['requests']} completed, {s['identical_to_fixed']} identical to the "
              f"fixed run's, {s['attainment']:.0%} met both SLOs (goodput {s['goodput']:.2f} req/s)", flush=True)
    write(report, Path(args.out_dir) if args.out_dir else RESULTS)
    return 0


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "planner_trace.json").write_text(json.dumps(report, indent=1) + "\n")
    phases = ", ".join(f"{r:g} req/s for {s:g} s" for r, s in report["phases"])
    lines = ["# `epdserve up --planner` through a rising and falling load", "",
             f"{report['date']}, {report['machine']}; {report['model']}, one thread per engine; {phases}; "
             f"{report['input_len']} in / {report['output_len']} out tokens, greedy, streamed; SLOs TTFT <= "
             f"{report['slo']['ttft']} s, TPOT <= {report['slo']['tpot'] * 1e3:g} ms; planner bounds "
             f"{report['bounds']}, every {report['interval']:g} s; fixed layout {report['fixed']} (P:D).", "",
             "| run | requests | completed | identical to fixed | met both SLOs | goodput req/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in report["runs"].items():
        lines.append(f"| {name} | {s['requests']} | {s['completed']} | {s['identical_to_fixed']} | "
                     f"{s['attainment']:.0%} | {s['goodput']:.2f} |")
    lines += ["", "Planner decisions:", "", "```", *report["runs"]["planner"]["decisions"], "```"]
    (out_dir / "planner_trace.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t, edges = 0.0, []
    for rate, seconds in report["phases"]:
        edges.append((t, t + seconds, rate))
        t += seconds
    for role, style in (("prefill", "-"), ("decode", "--")):
        tl = report["runs"]["planner"]["timeline"]
        top.step([p["t"] for p in tl], [p["ready"].get(role, 0) for p in tl], style, where="post",
                 label=f"{role}s ready (planner)")
    rates = top.twinx()
    rates.step([a for a, _, _ in edges] + [edges[-1][1]], [r for _, _, r in edges] + [edges[-1][2]], "k:",
               where="post", label="request rate")
    rates.set_ylabel("req/s")
    top.set_ylabel("instances")
    top.legend(loc="upper left")
    for name, s in report["runs"].items():
        points = [(c, a) for c, a in s["windows"] if a is not None]
        bottom.plot([c for c, _ in points], [a for _, a in points], "o-", label=name)
    bottom.set_ylabel(f"met both SLOs ({WINDOW_S:.0f} s windows)")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, 1.05)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "planner_trace.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
