"""Stream migration: what it costs when nothing fails, and what a client sees when a decode dies.

1. Cost: two `epdserve up` stacks of 1 prefill + 1 decode (prefill on the first CPU, decode on the last), one with
   migration on (`--migration-limit 3`, the default) and one with it off (0), both up at once and measured in
   turn by `epdserve bench serve` (random 128-token prompts, 128 output tokens, EOS ignored, rate inf) - runs
   interleaved, each cell the median of --repeats; the ratio on/off.
2. A fault: a stack of 1 prefill + 2 decodes streams --streams greedy requests at once; once every stream has
   tokens, the decode serving most of them is SIGKILLed. Streams completed, identical to the same requests
   run without the fault, the longest silence any stream saw, and migrations counted by the proxy. `epdserve
   up` restarts the decode meanwhile.

Writes benchmarks/results/migration.{json,md}.

    .venv/bin/python benchmarks/migration.py                 # ~10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import openai

from serving_vs_vllm import RESULTS, default_model, epdserve_bench
from stacks import Stack, machine


def cost(args: argparse.Namespace, log_dir: Path, tmp: Path) -> dict:
    stacks = {label: Stack(label, args.model, ["--encoders", "0", "--threads", "1", "--migration-limit", limit], [],
                           {"prefill": "0", "decode": str(os.cpu_count() - 1), "proxy": f"0-{os.cpu_count() - 1}"},
                           log_dir)
              for label, limit in (("on", "3"), ("off", "0"))}
    runs: dict[str, list[dict]] = {label: [] for label in stacks}
    try:
        for stack in stacks.values():
            stack.start(600)
        bench = ["--model", args.served_name, "--tokenizer", args.model, "--dataset-name", "random",
                 "--input-len", "128", "--output-len", "128", "--num-prompts", str(args.num_prompts),
                 "--request-rate", "inf"]
        for r in range(args.repeats):
            for label, stack in stacks.items():
                result = epdserve_bench(stack.url, args, bench, seed=70 + r, out=tmp / f"{label}-{r}.json")
                runs[label].append({k: result[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")})
                print(f"  migration {label:3}  run {r + 1}: {result['output_throughput']:7.1f} out tok/s  "
                      f"TPOT p50 {result['median_tpot_ms']:6.1f} ms", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
    medians = {label: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for label, rs in runs.items()}
    return {"runs": runs, "median": medians,
            "ratio_on_off": {k: medians["on"][k] / medians["off"][k] for k in medians["on"]}}


async def _streams(url: str, model: str, n: int, progress: dict | None = None,
                   stalls: dict | None = None) -> list[str]:
    async def one(c, i: int) -> str:
        text, last = "", time.monotonic()
        async for event in await c.completions.create(model=model, prompt=f"Story {i}: once upon a time",
                                                      max_tokens=200, temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True}):
            now = time.monotonic()
            if stalls is not None:
                stalls[i] = max(stalls.get(i, 0.0), now - last)
            last = now
            if event.choices:
                text += event.choices[0].text
                if progress is not None:
                    progress[i] = progress.get(i, 0) + 1
        return text

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        return list(await asyncio.gather(*(one(c, i) for i in range(n))))


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def fault(args: argparse.Namespace, log_dir: Path) -> dict:
    stack = Stack("fault", args.model, ["--encoders", "0", "--threads", "1", "--decodes", "2"], [], {}, log_dir)
    try:
        stack.start(600)
        expected = asyncio.run(_streams(stack.url, args.served_name, args.streams))
        ports = stack.http_ports()

        async def run() -> tuple[list[str], dict, str]:
            progress, stalls = {}, {}
            task = asyncio.create_task(_streams(stack.url, args.served_name, args.streams, progress, stalls))
            while len(progress) < args.streams:
                await asyncio.sleep(0.05)
            busiest = max(("decode-0", "decode-1"), key=lambda d: _metric(ports[d], "epdserve:num_requests_running"))
            pid = next(pid for pid, role in stack.services.items() if role == "decode"
                       and f"--engine-id\0{busiest}\0" in Path(f"/proc/{pid}/cmdline").read_text())
            os.kill(pid, signal.SIGKILL)
            return await task, stalls, busiest

        texts, stalls, killed = asyncio.run(run())
        migrations = _metric(stack.port, "epdserve:request_migrations_total")  # the proxy's
        return {"streams": args.streams, "killed": killed, "completed": len(texts),
                "identical": sum(a == b for a, b in zip(texts, expected)),
                "longest_stall_s": max(stalls.values()), "migrations": migrations}
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--output", type=Path, default=RESULTS / "migration.json")
    args = parser.parse_args()
    args.model = args.model or default_model()
    args.served_name = Path(args.model).name
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        record = {"machine": machine(), "date": datetime.now().isoformat(timespec="seconds"),
                  "command": "python benchmarks/migration.py", "cost": cost(args, log_dir, log_dir),
                  "fault": fault(args, log_dir)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    c, f = record["cost"], record["fault"]
    lines = ["# Stream migration", "", f"`{record['command']}` on {record['date']}: {record['machine']}.", "",
             "## Cost when nothing fails (1 prefill + 1 decode, rate inf, median of "
             f"{args.repeats})", "", "| migration | out tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|"]
    for label in ("on", "off"):
        m = c["median"][label]
        lines.append(f"| {label} | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | "
                     f"{m['median_tpot_ms']:.1f} |")
    r = c["ratio_on_off"]
    lines += [f"| on / off | {r['output_throughput']:.3f}x | {r['median_ttft_ms']:.3f}x | "
              f"{r['median_tpot_ms']:.3f}x |", "",
              "## A decode SIGKILLed mid-stream (1 prefill + 2 decodes)", "",
              "| streams | completed | identical to no fault | longest stall s | migrations |", "|---|---|---|---|---|",
              f"| {f['streams']} | {f['completed']} | {f['identical']} | {f['longest_stall_s']:.2f} | "
              f"{f['migrations']:.0f} |"]
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
