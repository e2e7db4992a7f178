"""Multi-LoRA serving: what mixing adapters into a batch costs, against the base model alone, and against vLLM
serving the same adapters (`vllm serve --enable-lora --lora-modules`), in the same run, on the same CPUs.

For each server, one at a time (each computing on every CPU of --cpus):

    unified    epdserve up --unified --enable-lora --lora-modules a0=... a7=... --max-loras 8
    vllm       vllm serve MODEL --enable-lora --lora-modules a0=... a7=... --max-loras 8 (float32)

and for each mix of --mixes (0: the base model only; k: requests spread round-robin over adapters a0..a(k-1)),
--num-prompts streamed /v1/completions requests of --input-len random prompt tokens and --output-len tokens
(EOS ignored, greedy) are sent at once (at most --concurrency in flight). The client is this script's own,
the same for both servers, since the mix needs a `model` per request. Reported per (server, mix), the median of
--repeats runs (each on prompts of its own, the same for both servers): output
throughput, the median and p99 TPOT (time per output token after the first, per request), median TTFT, and
the ratio to the same server's base-only run (the cost of the adapters) and to vLLM's (same mix).
Writes benchmarks/results/lora.{json,md,png}.

The adapters are made by the project's own builder (PEFT, fixed seeds): rank --rank on q/k/v/o/gate/up/down.

    .venv/bin/python benchmarks/lora.py                     # SmolLM2, both servers (needs .venv-vllm)
    .venv/bin/python benchmarks/lora.py --quick             # a tiny model, epdserve only, a few seconds
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from stacks import ROOT, Stack, VllmServer, cpu_list, machine, shown_path

RESULTS = ROOT / "benchmarks" / "results"
SERVED_NAME = "base"


def build_adapters(model: str, folder: Path, count: int, rank: int) -> dict[str, str]:
    from epdserve.shared.checkpoints.tiny_lora import ALL_MODULES, build_tiny_lora

    return {f"a{i}": str(build_tiny_lora(model, folder / f"a{i}", "all", seed=100 + i, r=rank, lora_alpha=2 * rank,
                                         target_modules=ALL_MODULES))
            for i in range(count)}


def make_server(name: str, args: argparse.Namespace, adapters: dict[str, str], log_dir: Path):
    modules = [f"{n}={p}" for n, p in adapters.items()]
    lora = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
            "--lora-modules", *modules]
    if name == "vllm":
        server = VllmServer(args.model, SERVED_NAME, args.cpus, log_dir)
        server.argv += [*lora, "--max-cpu-loras", str(len(adapters))]
        return server
    return Stack(name, args.model, ["--unified", "--encoders", "0", "--threads", str(len(cpu_list(args.cpus))),
                                    "--served-model-name", SERVED_NAME, *lora], [],
                 {"unified": args.cpus, "proxy": args.cpus}, log_dir)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens, "end": end}


async def run_mix(url: str, args: argparse.Namespace, mix: int, prompts: list[list[int]]) -> dict:
    models = [SERVED_NAME] if mix == 0 else [f"a{i}" for i in range(mix)]
    limit = asyncio.Semaphore(args.concurrency)

    async def bounded(client, i, prompt):
        async with limit:
            return await one_request(client, url, models[i % len(models)], prompt, args.output_len)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, i, p) for i, p in enumerate(prompts)))
    elapsed = max(r["end"] for r in results) - start
    tpots = sorted(r["tpot"] * 1000 for r in results)
    return {"mix": mix, "num_requests": len(results),
            "output_throughput": sum(r["tokens"] for r in results) / elapsed,
            "median_tpot_ms": statistics.median(tpots),
            "p99_tpot_ms": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
            "median_ttft_ms": statistics.median(r["ttft"] * 1000 for r in results)}


def median_row(runs: list[dict]) -> dict:
    """The median of each metric over repeated runs of one (server, mix), with the throughput's spread."""
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("mix", "num_requests")}
    row["output_throughput_min"] = min(r["output_throughput"] for r in runs)
    row["output_throughput_max"] = max(r["output_throughput"] for r in runs)
    return {"mix": runs[0]["mix"], "num_requests": runs[0]["num_requests"], "repeats": len(runs), **row}


def prompts_for(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def measure(name: str, args: argparse.Namespace, adapters: dict[str, str], log_dir: Path, vocab: int) -> list[dict]:
    server = make_server(name, args, adapters, log_dir)
    server.start(args.startup_timeout)
    try:
        warm = argparse.Namespace(**{**vars(args), "output_len": 4})
        asyncio.run(run_mix(server.url, warm, max(args.mixes), prompts_for(warm, vocab, 0)[:8]))
        rows = []
        for mix in args.mixes:
            # Every server gets the same prompts; each (mix, run) its own, so that no run is served from
            # blocks an earlier one cached under the same adapter.
            runs = [asyncio.run(run_mix(server.url, args, mix, prompts_for(args, vocab, 1 + 100 * mix + r)))
                    for r in range(args.repeats)]
            row = median_row(runs)
            rows.append({"server": name, **row})
            print(f"{name:8} {mix} adapters: {row['output_throughput']:8.1f} out tok/s  TPOT p50 "
                  f"{row['median_tpot_ms']:7.1f} ms  p99 {row['p99_tpot_ms']:7.1f} ms  TTFT p50 "
                  f"{row['median_ttft_ms']:7.1f} ms", flush=True)
        return rows
    finally:
        server.stop()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (thr, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == server]
        mixes = [r["mix"] for r in mine]
        thr.plot(mixes, [r["output_throughput"] for r in mine], marker="o", label=server)
        thr.fill_between(mixes, [r["output_throughput_min"] for r in mine],
                         [r["output_throughput_max"] for r in mine], alpha=0.2)
        tpot.plot(mixes, [r["median_tpot_ms"] for r in mine], marker="o", label=server)
    thr.set(xlabel="adapters mixed (0: base only)", ylabel="output tok/s", title="throughput (median, min-max)")
    tpot.set(xlabel="adapters mixed (0: base only)", ylabel="ms", title="TPOT p50")
    thr.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    base = {r["server"]: r for r in rows if r["mix"] == 0}
    vllm = {r["mix"]: r for r in rows if r["server"] == "vllm"}
    lines = ["| server | adapters mixed | out tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms "
             "| throughput vs base only | throughput vs vLLM |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own, peer = base.get(r["server"]), vllm.get(r["mix"])
        vs_base = f"{r['output_throughput'] / own['output_throughput']:.2f}x" if own else "-"
        vs_vllm = f"{r['output_throughput'] / peer['output_throughput']:.2f}x" if peer else "-"
        lines.append(f"| {r['server']} | {r['mix'] or 'none (base)'} | {r['output_throughput']:.1f} | "
                     f"{r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} | {r['median_ttft_ms']:.1f} | {vs_base} | "
                     f"{vs_vllm} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct; --quick: a tiny llama)")
    p.add_argument("--servers", nargs="+", choices=["unified", "vllm"], default=["unified", "vllm"])
    p.add_argument("--mixes", nargs="+", type=int, default=[0, 1, 4, 8],
                   help="adapters spread over the requests; 0: the base model only")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--cpus", default="0-1", help="CPUs every server computes on (taskset list)")
    p.add_argument("--repeats", type=int, default=3, help="runs per (server, mix); cells are their median")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/lora.json; --quick: a "
                                            "temporary folder)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a tiny random llama, epdserve only, 8 prompts of 32 tokens, 8 output tokens")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    if args.quick:
        from epdserve.shared.checkpoints.default_model import prepare_default_model
        from epdserve.shared.checkpoints.tiny_models import build_tiny_model

        args.model = args.model or str(build_tiny_model("llama", work / "tiny-llama", prepare_default_model()))
        args.servers, args.num_prompts, args.concurrency = ["unified"], 8, 8
        args.input_len, args.output_len, args.repeats = 32, 8, 1
        args.out = args.out or work / "lora.json"
    if args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    args.out = args.out or RESULTS / "lora.json"
    adapters = build_adapters(args.model, work / "adapters", max(max(args.mixes), 1), args.rank)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    for name in args.servers:
        rows += measure(name, args, adapters, work, vocab)
    out_name = str(args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out)
    report = {"date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "model": shown_path(args.model),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model")} | {"out": out_name},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(f"# Multi-LoRA serving\n\n{report['machine']}, {report['model']}, "
                                           f"{report['date']}, median of {args.repeats} runs\n\n{table(rows)}\n")
    plot(rows, args.out.with_suffix(".png"))
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
