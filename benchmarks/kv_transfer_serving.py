"""The KV transfer inside a serving stack, per request: 1 prefill + 1 decode over ZeroMQ and over UCX.

Each stack is `epdserve up` with one prefill (pinned to the first CPU) and one decode (the last), load
routing (so that every prompt is prefilled by the prefill and its KV pulled by the decode) and
--request-trace; `epdserve bench serve --trace` sends it random prompts of each --input-lens, one at a
time (no queueing in the numbers), and reads each request's server-side trace. Per request it records
the `kv.transfer` span (time and bytes), TTFT, and their ratio; per cell the medians, median of
--repeats runs.

In this layout the first token comes from prefill, before the pull: the transfer delays the second
token, not the first, so "transfer / TTFT" compares the transfer with the prefill that precedes it.

    .venv/bin/python benchmarks/kv_transfer_serving.py             # writes results/kv_transfer_serving.{md,json}
    .venv/bin/python benchmarks/kv_transfer_serving.py --transports zmq --input-lens 1024 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from serving_vs_vllm import epdserve_bench
from stacks import ROOT, Stack, machine

RESULTS = ROOT / "benchmarks" / "results"
CELL = ("median_kv_transfer_ms", "median_kv_transfer_bytes", "median_ttft_ms", "median_kv_transfer_ttft_ratio")


def bench(url: str, model: str, input_len: int, args: argparse.Namespace, seed: int, out: Path) -> dict:
    result = epdserve_bench(url, args, [
        "--tokenizer", model, "--dataset-name", "random", "--input-len", str(input_len), "--output-len",
        str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency", "1", "--trace"], seed, out)
    if result["kv_transfer_requests"] != args.num_prompts:
        raise RuntimeError(f"{result['kv_transfer_requests']} of {args.num_prompts} requests pulled their KV, "
                           f"{result['kv_recompute_requests']} recomputed")
    return result


def per_request(result: dict) -> list[dict]:
    """Each request's KV pull and TTFT, from its trace."""
    rows = []
    for ttft, traces in zip(result["ttfts"], result["traces"]):
        spans = [s for trace in traces or () for s in trace["spans"] if s["name"] == "kv.transfer"]
        seconds = sum(s["end"] - s["start"] for s in spans)
        rows.append({"request_id": traces[0]["request_id"] if traces else None, "ttft_ms": round(ttft * 1e3, 2),
                     "kv_transfer_ms": round(seconds * 1e3, 2), "kv_transfer_bytes": sum(s["num_bytes"] for s in spans),
                     "kv_blocks": sum(s["num_blocks"] for s in spans)})
    return rows


def measure(transport: str, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    stack = Stack(f"pd-{transport}", model,
                  ["--encoders", "0", "--threads", "1", "--routing-policy", "load", "--request-trace",
                   "--kv-transport", transport], [], {"prefill": args.cpus[0], "decode": args.cpus[-1],
                                                      "proxy": ",".join(args.cpus)}, tmp)
    print(f"{transport}: starting", flush=True)
    stack.start(args.startup_timeout)
    out: dict = {"pinning": stack.pinning}
    try:
        bench(stack.url, model, 64, argparse.Namespace(**{**vars(args), "num_prompts": 2}), 999,
              tmp / f"{transport}-warmup.json")  # untimed: connections, allocators
        for input_len in args.input_lens:
            runs = [bench(stack.url, model, input_len, args, seed=100 * r + input_len,
                          out=tmp / f"{transport}-{input_len}-{r}.json") for r in range(args.repeats)]
            cell = {key: statistics.median(run[key] for run in runs) for key in CELL}
            cell["kv_transfer_gbps"] = cell["median_kv_transfer_bytes"] / cell["median_kv_transfer_ms"] / 1e6
            cell["requests"] = per_request(runs[-1])
            out[f"input-{input_len}"] = cell
            print(f"  {transport} {input_len:>5} tokens: transfer {cell['median_kv_transfer_ms']:.1f} ms "
                  f"({cell['median_kv_transfer_bytes'] / 1e6:.1f} MB, {cell['kv_transfer_gbps']:.2f} GB/s), TTFT "
                  f"{cell['median_ttft_ms']:.0f} ms, transfer / TTFT {cell['median_kv_transfer_ttft_ratio']:.3f}",
                  flush=True)
    finally:
        stack.stop()
    return out


def markdown(report: dict) -> str:
    lines = ["# KV transfer per request in a 1 prefill + 1 decode stack", "",
             f"`{report['command']}` — {report['machine']}, {report['date']}. SmolLM2-135M-Instruct, float32, "
             f"one request at a time, {report['num_prompts']} prompts per run, median of {report['repeats']} runs "
             "(each cell: median over its requests). From each request's server-side trace (`--request-trace`, "
             "`epdserve bench serve --trace`).", "",
             "| transport | prompt | KV pulled | transfer | rate | TTFT | transfer / TTFT |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for transport, cells in report["results"].items():
        for name, cell in cells.items():
            if not name.startswith("input-"):
                continue
            lines.append(f"| {transport} | {name[6:]} tokens | {cell['median_kv_transfer_bytes'] / 1e6:.1f} MB | "
                         f"{cell['median_kv_transfer_ms']:.1f} ms | {cell['kv_transfer_gbps']:.2f} GB/s | "
                         f"{cell['median_ttft_ms']:.0f} ms | {cell['median_kv_transfer_ttft_ratio']:.3f} |")
    lines += ["", "The first token comes from prefill, before the pull: the transfer delays the second token, "
              "not the first. Per-request rows (request id, TTFT, transfer time, bytes, blocks) are in the JSON."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--transports", default="zmq,ucx")
    p.add_argument("--input-lens", default="1024,4096")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpus", default="0,1", help="prefill's CPU, decode's CPU")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    args.input_lens = [int(n) for n in args.input_lens.split(",")]
    args.cpus = args.cpus.split(",")
    if not args.model:
        from epdserve.shared.checkpoints.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    report = {"benchmark": "kv_transfer_serving", "command": "python " + " ".join(sys.argv), "machine": machine(),
              "date": datetime.now().isoformat(timespec="seconds"), "num_prompts": args.num_prompts,
              "repeats": args.repeats, "output_len": args.output_len, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for transport in args.transports.split(","):
            report["results"][transport] = measure(transport, args.model, args, Path(tmp))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_transfer_serving.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "kv_transfer_serving.md").write_text(markdown(report))
    print(f"wrote {out / 'kv_transfer_serving.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
