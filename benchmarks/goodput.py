"""Goodput under latency SLOs: short chats mixed with long prompts, swept over request rates, on `vllm serve`, an
epdserve unified stack and a 1 prefill + 1 decode stack, one at a time (taking turns) on the same CPUs.

Servers (each computing on every CPU of --cpus, as in serving_vs_vllm.py; every engine's KV pool is
--kv-cache-gb GiB, vLLM's too):

    vllm       vllm serve MODEL --dtype float32 (from .venv-vllm, benchmarks/setup_vllm_cpu.sh)
    unified    epdserve up --unified --threads N (N = number of --cpus)
    pd         epdserve up, 1 prefill + 1 decode: prefill pinned to the first CPU, decode to the last, one thread
               each (prefill never stalls a running decode; each role has half the cores)

Workload, deterministic from --seed and the same for every server: --num-requests streamed /v1/completions
requests per run, prompts of random token ids, EOS ignored (every request writes its whole --output-len), the
API's default sampling unless --temperature. Most are chats of --short-prompt tokens; exactly
round(--long-share x --num-requests), at seeded places, are long prompts of --long-prompt tokens (a document
to summarise, a long history). They arrive as a Poisson process at each rate of --rates: a run's lengths,
kinds and unit-rate gaps are the same at every rate (only the pace differs), its prompt tokens are its own, so
no run meets a prefix cache another one filled.

SLOs (flags; the report states them):

    TTFT <= max(--ttft-slo-ms, --ttft-slo-ms-per-token x prompt tokens): 2 s for a chat, whose prefill alone
         takes a fraction of that here; 4 ms per prompt token for long prompts (8-16 s at 2-4k tokens): a user
         who sends a document waits longer than for a chat line, and one core alone prefills this model's 1k-
         token prompts in about 1.8 s and 4k-token ones in 13-15 s (kv_transfer_serving.py, 2 x AMD EPYC), so
         even pd's one prefill core meets it when idle: queueing, not the prompt, is what breaks it
    TPOT <= --tpot-slo-ms: 100 ms, 10 tokens/s, faster than people read (DistServe's chatbot TPOT SLO), and
         3-5x this model's TPOT on an idle 2-core server (22-30 ms at 1 req/s): only stalls and overload
         break it

The servers take turns: in each of --repeats rounds every server is started afresh and runs each rate once,
so a stretch in which the machine runs slow lands on all of them rather than on one server's runs.

Per (server, rate): goodput = rate x the share of requests meeting both SLOs (requests/s served within them;
a failed request meets neither), that share, the shares meeting TTFT alone and TPOT alone (which SLO binds),
failures, output throughput (median of --repeats runs); TTFT and TPOT p50/p99 of chats and of long prompts
(every run's requests pooled: a run holds only a few long ones); goodput under tighter and looser TPOT and
TTFT SLOs from the same requests; the highest swept rate at which each server keeps 90% of requests within
both SLOs; and per rate, which server wins and which SLO each misses.

Writes benchmarks/results/goodput.{json,md,png} (goodput and attainment against rate, one line per server).
The JSON keeps every request's TTFT and TPOT: --rescore FILE scores a past run under other SLOs, serving
nothing.

    .venv/bin/python benchmarks/goodput.py                     # vllm, unified, pd: 25-30 minutes on 2 cores
    .venv/bin/python benchmarks/goodput.py --servers unified,pd --rates 0.5,1 --repeats 1
    .venv/bin/python benchmarks/goodput.py --quick             # unified and pd on the tiny test model, 1-2 minutes
    .venv/bin/python benchmarks/goodput.py --rescore benchmarks/results/goodput.json --tpot-slo-ms 50
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from itertools import accumulate
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_report import SERVERS, Outcome, Slo, analyse, markdown, plot, score_run  # noqa: E402
from stacks import ROOT, VLLM_PYTHON, Stack, VllmServer, cpu_list, in_turns, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIRST_TOKEN = 300  # prompt token ids are drawn from [FIRST_TOKEN, vocab): no special tokens
REQUEST_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class Item:
    """One request of a workload: when it is sent (seconds after the run starts) and what it asks."""

    arrival_s: float
    prompt: list[int]  # token ids
    max_tokens: int
    long: bool


# -- the workload -------------------------------------------------------------------------------------------------
def workload(args: argparse.Namespace, vocab: int, repeat: int, rate_index: int, rate: float) -> list[Item]:
    """Repeat `repeat`'s requests at `rate`: kinds, lengths and unit-rate gaps from (seed, repeat) alone, prompt
    tokens from (seed, repeat, rate) too."""
    shape = random.Random(f"goodput/{args.seed}/{repeat}")
    n = args.num_requests
    kinds = [True] * num_long(args) + [False] * (n - num_long(args))
    shape.shuffle(kinds)
    lengths = [shape.randint(*(args.long_prompt if long else args.short_prompt)) for long in kinds]
    outputs = [shape.randint(*args.output_len) for _ in kinds]
    arrivals = [0.0, *accumulate(shape.expovariate(1.0) / rate for _ in range(n - 1))]
    tokens = random.Random(f"goodput/{args.seed}/{repeat}/{rate_index}")
    return [Item(at, [tokens.randrange(FIRST_TOKEN, vocab) for _ in range(length)], out, long)
            for at, length, out, long in zip(arrivals, lengths, outputs, kinds)]


def warmup_items(args: argparse.Namespace, vocab: int) -> list[Item]:
    """A few chats and one longest prompt at once, 8 tokens each: what first requests compile or allocate."""
    rng = random.Random(f"goodput/{args.seed}/warmup")
    lengths = [args.short_prompt[1]] * 3 + [args.long_prompt[1]]
    return [Item(0.0, [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)], 8, n == args.long_prompt[1])
            for n in lengths]


def num_long(args: argparse.Namespace) -> int:
    return round(args.long_share * args.num_requests)


# -- the client ---------------------------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, url: str, model: str, item: Item, start: float,
               temperature: float | None) -> Outcome:
    """Sends `item` at its arrival time and times its stream: TTFT to the first chunk with a choice (as
    `vllm bench serve`), TPOT over the rest, the token count from the stream's usage."""
    await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    failed = dict(prompt_tokens=len(item.prompt), output_tokens=0, long=item.long)
    sent, first, tokens = time.perf_counter(), None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(**failed, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return Outcome(**failed, error=f"in the stream: {str(chunk['error'])[:300]}")
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Outcome(**failed, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None or tokens != item.max_tokens:
        return Outcome(**failed, error=f"wrote {tokens} of {item.max_tokens} tokens")
    return Outcome(len(item.prompt), tokens, item.long, (first - sent) * 1e3,
                   (end - first) * 1e3 / max(tokens - 1, 1), (end - sent) * 1e3)


async def run_workload(url: str, items: list[Item], temperature: float | None) -> dict:
    """Every item at its time; the run's duration is from the first send to the last stream's end."""
    limits = httpx.Limits(max_connections=len(items) + 4, max_keepalive_connections=len(items) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        model = (await client.get(url + "/v1/models")).raise_for_status().json()["data"][0]["id"]
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(send(client, url, model, item, start, temperature) for item in items))
        duration = time.perf_counter() - start
    return {"duration_s": duration, "outcomes": [asdict(o) for o in outcomes]}


# -- the servers --------------------------------------------------------------------------------------------------
def make_server(name: str, args: argparse.Namespace, log_dir: Path):
    cpus = cpu_list(args.cpus)
    up_args = shlex.split(args.up_args)
    if name == "vllm":
        return VllmServer(args.model, Path(args.model).name, args.cpus, log_dir, kv_cache_gb=args.kv_cache_gb)
    engine = ["--kv-cache-memory", str(args.kv_cache_gb), *shlex.split(args.engine_args)]
    if name == "unified":
        return Stack(name, args.model, ["--unified", "--encoders", "0", "--threads", str(len(cpus)), *up_args],
                     engine, {"unified": args.cpus, "proxy": args.cpus}, log_dir)
    return Stack(name, args.model, ["--encoders", "0", "--threads", "1", *up_args], engine,
                 {"prefill": cpus[0], "decode": cpus[-1], "proxy": args.cpus}, log_dir)


def peer_version() -> str:
    """The installed vLLM's version, asked of its own venv."""
    ask = "import sys; sys.path.insert(0, 'benchmarks'); from vllm_cli import vllm_version; print(vllm_version())"
    proc = subprocess.run([str(VLLM_PYTHON), "-c", ask], capture_output=True, text=True, cwd=ROOT)
    return proc.stdout.strip() or "unknown"


def measure_round(name: str, args: argparse.Namespace, vocab: int, slo: Slo, log_dir: Path, rep: int,
                  record: dict) -> None:
    """Start `name`, run each rate once (run rep of each cell) into `record`, stop it."""
    server = make_server(name, args, log_dir)
    print(f"{name}: starting (round {rep + 1} of {args.repeats})", flush=True)
    server.start(args.startup_timeout)
    record["pinning"] = server.pinning
    try:
        warm = asyncio.run(run_workload(server.url, warmup_items(args, vocab), args.temperature))
        if errors := [o["error"] for o in warm["outcomes"] if o["error"]]:
            raise RuntimeError(f"{name}: the warm-up failed: {errors[0]}")
        for r_i, rate in enumerate(args.rates):
            run = asyncio.run(run_workload(server.url, workload(args, vocab, rep, r_i, float(rate)),
                                           args.temperature))
            record["rates"].setdefault(rate, []).append(run)
            s = score_run(run, float(rate), slo)
            print(f"  {name:<8} {rate:>5} req/s run {rep + 1}: goodput {s['goodput']:5.2f} req/s, "
                  f"{s['attainment']:4.0%} met both (TTFT {s['ttft_attainment']:4.0%}, TPOT "
                  f"{s['tpot_attainment']:4.0%}), {s['failed']} failed, {run['duration_s']:.0f} s", flush=True)
            if first_error := next((o["error"] for o in run["outcomes"] if o["error"]), None):
                print(f"    first failure: {first_error}", flush=True)
    finally:
        server.stop()


def measure(args: argparse.Namespace, vocab: int, slo: Slo, log_dir: Path) -> dict[str, dict]:
    """Every server's runs, the servers taking turns (stacks.in_turns), each rate once a round."""
    records = {name: {"pinning": {}, "rates": {}} for name in args.servers}
    for rep, name in in_turns(args.servers, args.repeats):
        measure_round(name, args, vocab, slo, log_dir, rep, records[name])
    return records


# -- arguments ----------------------------------------------------------------------------------------------------
def token_range(value: str) -> tuple[int, int]:
    """'LO-HI' or 'N' (both ends included)."""
    lo, _, hi = value.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI or N, got {value!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {value!r}")
    return bounds


def rate_labels(value: str) -> list[str]:
    """Comma-separated request rates, each finite and positive (goodput needs arrivals at a rate)."""
    labels = []
    for part in value.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not (math.isfinite(rate) and rate > 0):
            raise argparse.ArgumentTypeError(f"rates must be finite and positive, got {part!r}")
        labels.append(f"{rate:g}")
    return labels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct; --quick: the tiny test llama)")
    p.add_argument("--servers", default=",".join(SERVERS), help="subset of " + ",".join(SERVERS))
    p.add_argument("--cpus", default="0-1", help="the CPUs every server gets (pd: prefill first, decode last)")
    p.add_argument("--rates", type=rate_labels, default=rate_labels("0.4,0.8,1.2"),
                   help="req/s (default: 0.4,0.8,1.2)")
    p.add_argument("--num-requests", type=int, default=24, help="requests per run (default: %(default)s)")
    p.add_argument("--long-share", type=float, default=0.125,
                   help="share of long prompts, rounded to a whole number of requests (default: %(default)s)")
    p.add_argument("--short-prompt", type=token_range, default=(128, 256), metavar="LO-HI",
                   help="chat prompt tokens (default: 128-256)")
    p.add_argument("--long-prompt", type=token_range, default=(2048, 4096), metavar="LO-HI",
                   help="long prompt tokens (default: 2048-4096)")
    p.add_argument("--output-len", type=token_range, default=(64, 128), metavar="LO-HI",
                   help="output tokens of every request (default: 64-128)")
    p.add_argument("--temperature", type=float, help="default: the API's (1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per (server, rate); cells are their median")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO of a chat (default: %(default)g)")
    p.add_argument("--ttft-slo-ms-per-token", type=float, default=4.0,
                   help="TTFT SLO per prompt token, where that is more than --ttft-slo-ms (default: %(default)g)")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT SLO (default: %(default)g)")
    p.add_argument("--kv-cache-gb", type=int, default=2, help="KV pool of every engine, GiB (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: unified and pd on the tiny test llama, 12 requests (2 long ones of 768-1024 "
                        "tokens), rates 4 and 12, 2 runs each; writes nothing unless --out-dir is given")
    p.add_argument("--rescore", type=Path, metavar="JSON",
                   help="score the requests of a past run under the SLOs given here; serves nothing, prints the "
                        "tables, writes them only to --out-dir")
    p.add_argument("--up-args", default="", metavar="ARGS",
                   help="options for every `epdserve up`, e.g. \"--max-prefill-queue-tokens 0\"")
    p.add_argument("--engine-args", default="", metavar="ARGS",
                   help="options for every epdserve engine, e.g. \"--budget-policy shared --max-num-batched-tokens "
                        "2048\"")
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.long_share, args.repeats = 12, 1 / 6, 2
        args.short_prompt, args.long_prompt, args.output_len = (32, 64), (768, 1024), (8, 16)
        args.rates, args.kv_cache_gb = ["4", "12"], 1
        if "vllm" in args.servers.split(","):
            args.servers = "unified,pd"
    args.servers = args.servers.split(",")
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"--servers: unknown {sorted(unknown)}")
    if not 0 <= args.long_share <= 1:
        p.error("--long-share must be between 0 and 1")
    if args.num_requests < 1 or args.repeats < 1:
        p.error("--num-requests and --repeats must be at least 1")
    return args


def write(report: dict, summary: dict, out_dir: Path | None) -> None:
    text = markdown(report, summary)
    print(text)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "goodput.json").write_text(json.dumps({**report, "summary": summary}, indent=1) + "\n")
    (out_dir / "goodput.md").write_text(text)
    plot(report, summary, out_dir / "goodput.png")
    print(f"wrote {out_dir}/goodput.{{json,md,png}}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the server under test too
    args = parse_args(argv)
    slo = Slo(args.ttft_slo_ms, args.ttft_slo_ms_per_token, args.tpot_slo_ms)
    if args.rescore:
        report = json.loads(args.rescore.read_text())
        write(report, analyse(report, slo), args.out_dir)
        return 0
    if args.model is None:
        from epdserve.services.cli.main import prepare_model

        args.model = str(prepare_model("tiny-llama" if args.quick else "smollm2"))
    config = json.loads((Path(args.model) / "config.json").read_text())
    longest = max(args.short_prompt[1], args.long_prompt[1]) + args.output_len[1]
    if longest > config.get("max_position_embeddings", longest):
        raise SystemExit(f"{Path(args.model).name} takes {config['max_position_embeddings']} tokens; a prompt of "
                         f"{args.long_prompt[1]} and {args.output_len[1]} output tokens is {longest}")
    report = {
        "benchmark": "goodput",
        "command": "benchmarks/goodput.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
        "config": {"model": Path(args.model).name, "cpus": args.cpus, "rates": args.rates, "repeats": args.repeats,
                   "num_requests": args.num_requests, "num_long": num_long(args), "short_prompt": args.short_prompt,
                   "long_prompt": args.long_prompt, "output_len": args.output_len, "seed": args.seed,
                   "sampling": "API default sampling" if args.temperature is None else
                   f"temperature {args.temperature:g}", "kv_cache_gb": args.kv_cache_gb},
        "servers": {},
    }
    if "vllm" in args.servers:
        report["vllm_version"] = peer_version()
    window = sum(args.num_requests / float(r) for r in args.rates) * args.repeats
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        print(f"{slo.describe()}; arrivals span about {window / 60:.1f} minutes per server; logs in {tmp}", flush=True)
        report["servers"] = measure(args, config["vocab_size"], slo, Path(tmp))
    write(report, analyse(report, slo), args.out_dir or (None if args.quick else RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
