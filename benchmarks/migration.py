"""Stream migration: what it costs when nothing fails, and what a client sees when a decode dies.

1. Cost: two `epdserve up` stacks of 1 prefill + 1 decode (prefill on the first CPU, decode on the last), one with
   migration on (`--migration-limit 3`, the default) and one with it off (0), both up at once and measured in
   turn by `epdserve bench serve` (random 128-token prompts, 128 output tokens, EOS ignored, rate inf) - runs
   interleaved, the order reversed every round (on-off, off-on, ...: a machine's drift lands on both), each
   cell the median of --repeats; the ratio on/off, and how far each setting's own runs spread (the noise).
2. Faults: one `epdserve up` of 2 prefills + 2 decodes streams --streams greedy requests at once per fault
   (FAULTS: a decode SIGKILLed, frozen with SIGSTOP, or drained past its grace with SIGTERM once every stream
   has tokens; a prefill SIGKILLed as the streams are sent), the busiest instance of the role hit. Per
   fault: streams completed, identical to the same requests run without a fault, KV blocks still held once
   idle, the longest silence any stream saw, and migrations counted by the proxy. `epdserve up` restarts
   the victim meanwhile; the next fault waits until the stack healed.

Writes benchmarks/results/migration.{json,md}.

    .venv/bin/python benchmarks/migration.py                 # ~25 minutes on 2 cores
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
            for label, stack in sorted(stacks.items(), reverse=r % 2 == 1):
                result = epdserve_bench(stack.url, args, bench, seed=70 + r, out=tmp / f"{label}-{r}.json")
                runs[label].append({k: result[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")})
                print(f"  migration {label:3}  run {r + 1}: {result['output_throughput']:7.1f} out tok/s  "
                      f"TPOT p50 {result['median_tpot_ms']:6.1f} ms", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
    medians = {label: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for label, rs in runs.items()}
    # One setting's own spread, (max - min) / median: a ratio inside it is not told apart from noise.
    spread = {label: {k: (max(run[k] for run in rs) - min(run[k] for run in rs)) / medians[label][k] for k in rs[0]}
              for label, rs in runs.items()}
    return {"runs": runs, "median": medians, "spread": spread,
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


def _metrics(port: int) -> dict[str, float]:
    """A service's Prometheus metrics, each name's samples summed over its labels."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _held_blocks(stack: Stack) -> dict[str, int]:
    """KV blocks each engine holds (its pool less its free blocks) once idle, or when a minute ran out."""
    deadline = time.monotonic() + 60
    while True:
        held = {}
        for name, port in stack.http_ports().items():
            try:
                m = _metrics(port)
                held[name] = int(m["epdserve:num_kv_blocks"] - m["epdserve:num_free_kv_blocks"])
            except OSError:  # restarting
                held[name] = -1
        if all(n == 0 for n in held.values()) or time.monotonic() > deadline:
            return {name: n for name, n in held.items() if n}
        time.sleep(1)


def _healed(stack: Stack, want: dict[str, int], timeout: float = 300) -> None:
    """Wait until the proxy sees `want` healthy instances per role again (`epdserve up` restarts the dead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = json.loads(urllib.request.urlopen(stack.url + "/ready", timeout=5).read())
            if all(body["healthy_instances"].get(role, 0) >= n for role, n in want.items()):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the stack did not heal within {timeout:.0f}s:\n{stack.tail()}")


def _pid(stack: Stack, engine: str) -> int:
    return next(pid for pid, role in stack.find_services().items() if role in ("prefill", "decode")
                and f"--engine-id\0{engine}\0" in Path(f"/proc/{pid}/cmdline").read_text())


# fault -> (role of the victim, signal, when): "streaming" once every stream has tokens, "sent" as soon as the
# streams are sent (prefills are then computing them). A paused victim is resumed once the streams ended.
FAULTS = {"none": None,
          "kill-decode": ("decode", signal.SIGKILL, "streaming"),
          "pause-decode": ("decode", signal.SIGSTOP, "streaming"),
          "drain-decode": ("decode", signal.SIGTERM, "streaming"),  # past its --drain-timeout
          "kill-prefill": ("prefill", signal.SIGKILL, "sent")}


def fault(args: argparse.Namespace, log_dir: Path) -> list[dict]:
    """Each of --faults in turn on one `epdserve up` of 2 prefills + 2 decodes (healed between faults)."""
    shape = {"prefill": 2, "decode": 2}
    stack = Stack("fault", args.model, ["--encoders", "0", "--threads", "1", "--prefills", "2", "--decodes", "2"],
                  ["--drain-timeout", "3"], {}, log_dir)
    rows = []
    try:
        stack.start(600)
        expected = asyncio.run(_streams(stack.url, args.served_name, args.streams))
        for name in args.faults:
            role, sig, when = FAULTS[name] or (None, None, None)

            async def run() -> tuple[list[str], dict, str | None]:
                progress, stalls = {}, {}
                task = asyncio.create_task(_streams(stack.url, args.served_name, args.streams, progress, stalls))
                victim = None
                if role is not None:
                    while when == "streaming" and len(progress) < args.streams:
                        await asyncio.sleep(0.05)
                    ports = stack.http_ports()
                    victim = max((e for e in ports if e.startswith(role)),
                                 key=lambda e: _metrics(ports[e]).get("vllm:num_requests_running", 0))
                    pid = _pid(stack, victim)
                    os.kill(pid, sig)
                try:
                    return await task, stalls, victim
                finally:
                    if sig == signal.SIGSTOP:
                        os.kill(pid, signal.SIGCONT)

            before = _metrics(stack.port).get("epdserve:request_migrations_total", 0)
            texts, stalls, victim = asyncio.run(run())
            held = _held_blocks(stack)
            row = {"fault": name, "victim": victim, "streams": args.streams, "completed": len(texts),
                   "identical": sum(a == b for a, b in zip(texts, expected)),
                   "leaked_blocks": sum(n for n in held.values() if n > 0), "held_once_idle": held,
                   "longest_stall_s": max(stalls.values()),
                   "migrations": _metrics(stack.port).get("epdserve:request_migrations_total", 0) - before}
            print(f"  {name:13} {row}", flush=True)
            rows.append(row)
            _healed(stack, shape)
        return rows
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--faults", default=",".join(FAULTS), type=lambda v: v.split(","),
                        help=f"comma-separated, of {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--skip-cost", action="store_true", help="only the faults")
    parser.add_argument("--output", type=Path, default=RESULTS / "migration.json")
    args = parser.parse_args()
    args.model = args.model or default_model()
    args.served_name = Path(args.model).name
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        record = {"machine": machine(), "date": datetime.now().isoformat(timespec="seconds"),
                  "command": "python benchmarks/migration.py", "fault": fault(args, log_dir),
                  "cost": None if args.skip_cost else cost(args, log_dir, log_dir)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# Stream migration", "", f"`{record['command']}` on {record['date']}: {record['machine']}.", ""]
    if (c := record["cost"]) is not None:
        lines += ["## Cost when nothing fails (1 prefill + 1 decode, rate inf, median of "
                  f"{args.repeats}, order alternating; spread: a setting's own (max - min) / median)", "",
                  "| migration | out tok/s | TTFT p50 ms | TPOT p50 ms | spread out tok/s | spread TPOT |",
                  "|---|---|---|---|---|---|"]
        for label in ("on", "off"):
            m, sp = c["median"][label], c["spread"][label]
            lines.append(f"| {label} | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | "
                         f"{m['median_tpot_ms']:.1f} | {sp['output_throughput']:.1%} | {sp['median_tpot_ms']:.1%} |")
        r = c["ratio_on_off"]
        lines += [f"| on / off | {r['output_throughput']:.3f}x | {r['median_ttft_ms']:.3f}x | "
                  f"{r['median_tpot_ms']:.3f}x | | |", ""]
    lines += [f"## Faults on `epdserve up` (2 prefills + 2 decodes, engines' --drain-timeout 3; {args.streams} greedy "
              "streams of 200 tokens per fault; the busiest instance of the role is hit)", "",
              "| fault | streams | completed | identical to no fault | leaked blocks | longest stall s | migrations |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {f['fault']} | {f['streams']} | {f['completed']} | {f['identical']} | {f['leaked_blocks']} | "
              f"{f['longest_stall_s']:.2f} | {f['migrations']:.0f} |" for f in record["fault"]]
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
