"""KV beyond the pools: multi-turn chats whose working set is several times the engines' KV pools, on a
1 prefill + 2 decode stack, with the tiers off, with each engine's local offload tier, and with a shared
KV store - in one run, each on a stack of its own.

Each conversation opens with a document of its own (`--doc-len` tokens), then `--turns` user turns of
`--turn-len` tokens, each answered (`--reply-len` tokens, greedy, EOS ignored) before the next is sent with
the whole history. Turns go in waves (every conversation's first turn, then every second turn, ...),
`--concurrency` requests at a time, so by a conversation's next turn the others have pushed its blocks
out of every pool: the pools are sized to hold `1 / --oversubscription` of the working set (the documents
alone). Reported per mode: later-turn TTFT p50 and p99, prompt tokens the engines computed for later turns
(`epdserve:prompt_tokens_computed_total`, summed over the engines), tokens and bytes restored from the
tiers and their restore rate (bytes over the summed restore latency, `epdserve:kv_tier_restore_seconds`),
and whether every reply was the same token for token in every mode (it must be).

vLLM is not run here: its KV offloading (`--kv-offloading-size`) refuses any platform but CUDA-alike and XPU
GPUs ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs", vllm/v1/kv_offload/cpu/spec.py),
so its CPU build has no tier to compare with. Writes benchmarks/results/kv_tiers.{json,png}.

    python benchmarks/kv_tiers.py                  # 32 conversations on 2k-token documents: long on CPUs
    python benchmarks/kv_tiers.py --quick          # a tiny random model and a small workload: a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stacks import Stack, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("off", "local", "store")
COUNTERS = ("epdserve:prompt_tokens_computed_total", "epdserve:kv_tier_hit_tokens_total",
            "epdserve:kv_tier_restored_bytes_total", "epdserve:kv_tier_restore_seconds_sum",
            "epdserve:kv_tier_failed_restores_total")


def engine_counters(stack: Stack) -> dict[str, float]:
    """COUNTERS summed over the stack's engines (and over tiers)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for port in stack.http_ports().values():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               reply_len: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the reply's token ids) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": reply_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    started, ttft, tokens = time.perf_counter(), None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0].get("logprobs", {}) or {}
            if got.get("tokens"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                tokens += [int(t.removeprefix("token_id:")) for t in got["tokens"]]
    return ttft, tokens


async def run(stack: Stack, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)
    history = [[rng.randrange(300, vocab) for _ in range(args.doc_len)] for _ in range(args.conversations)]
    limit = asyncio.Semaphore(args.concurrency)
    later_ttft: list[float] = []
    replies: list[list[int]] = []
    async with httpx.AsyncClient(timeout=1800) as client:
        model = (await client.get(stack.url + "/v1/models")).json()["data"][0]["id"]

        async def one(conv: list[int]) -> tuple[float, list[int]]:
            async with limit:
                return await turn(client, stack.url, model, conv, args.reply_len)

        for t in range(args.turns):
            for conv in history:
                conv += [rng.randrange(300, vocab) for _ in range(args.turn_len)]
            if t == 1:
                before = engine_counters(stack)
            results = await asyncio.gather(*(one(conv) for conv in history))
            for conv, (ttft, reply) in zip(history, results):
                conv += reply
                replies.append(reply)
                if t >= 1:
                    later_ttft.append(ttft)
    after = engine_counters(stack)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    restore_s = delta["epdserve:kv_tier_restore_seconds_sum"]
    ordered = sorted(later_ttft)
    return {
        "later_turn_ttft_p50_ms": statistics.median(ordered) * 1e3,
        "later_turn_ttft_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
        "later_turn_prompt_tokens_computed": delta["epdserve:prompt_tokens_computed_total"],
        "later_turn_tokens_restored": delta["epdserve:kv_tier_hit_tokens_total"],
        "restored_gb": delta["epdserve:kv_tier_restored_bytes_total"] / 1e9,
        "restore_gb_per_s": delta["epdserve:kv_tier_restored_bytes_total"] / 1e9 / restore_s if restore_s else None,
        "failed_restores": delta["epdserve:kv_tier_failed_restores_total"],
        "replies": replies,
    }


def plot(summary: dict, path: Path) -> None:
    """Later-turn TTFT p50/p99 and prompt tokens computed, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    fig, (ttft, computed) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(modes))
    ttft.bar([i - 0.2 for i in x], [summary[m]["later_turn_ttft_p50_ms"] for m in modes], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [summary[m]["later_turn_ttft_p99_ms"] for m in modes], 0.4, label="p99")
    ttft.set_xticks(list(x), modes)
    ttft.set(ylabel="ms", title="later-turn TTFT")
    ttft.legend()
    computed.bar(list(x), [summary[m]["later_turn_prompt_tokens_computed"] for m in modes])
    computed.set_xticks(list(x), modes)
    computed.set(ylabel="tokens", title="later-turn prompt tokens computed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tiny_model(root: Path) -> str:
    from epdserve.shared.checkpoints.default_model import prepare_default_model
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return str(build_tiny_model("llama", root / "tiny-llama", prepare_default_model()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct; --quick: a tiny random one)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--turn-len", type=int, default=64)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--oversubscription", type=float, default=4.0,
                        help="working set (documents) over one engine's pool (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--offloading-size", type=float, default=4.0, help="GiB of each engine's local tier")
    parser.add_argument("--store-size", type=float, default=8.0, help="GiB of the shared store")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 6 conversations of 256 tokens")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.doc_len, args.turn_len, args.reply_len = 6, 2, 256, 16, 4
        args.offloading_size, args.store_size = 0.05, 0.1
    if args.turns < 2:
        parser.error("--turns must be at least 2: later turns are what is measured")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a subset of {','.join(MODES)}")
    log_dir = Path(tempfile.mkdtemp(prefix="kv-tiers-logs-"))
    if args.model is None:
        if args.quick:
            args.model = tiny_model(log_dir)
        else:
            from epdserve.shared.checkpoints.default_model import prepare_default_model
            args.model = str(prepare_default_model())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    working_blocks = args.conversations * -(-args.doc_len // args.block_size)
    pool_blocks = max(int(working_blocks / args.oversubscription),
                      2 * -(-(args.doc_len + args.turns * (args.turn_len + args.reply_len)) // args.block_size))
    print(f"working set {working_blocks} blocks, pools of {pool_blocks} blocks per engine; stack logs in {log_dir}",
          flush=True)
    # --max-queue-wait 0: --concurrency long prompts queue on the one prefill on purpose, and a turn refused
    # for the queue (what a production stack would want) would leave its TTFT out of the measurement.
    max_model_len = args.doc_len + args.turns * (args.turn_len + args.reply_len) + 16
    engine_args = ["--max-queue-wait", "0", "--num-kv-blocks", str(pool_blocks), "--block-size", str(args.block_size),
                   "--max-model-len", str(max_model_len)]
    results: dict[str, dict] = {}
    for mode in modes:
        up = ["--prefills", "1", "--decodes", "2", "--threads", "1", "--encoders", "0"]
        extra = list(engine_args)
        if mode == "local":
            extra += ["--kv-offloading-size", f"{args.offloading_size:g}"]
        if mode == "store":
            up += ["--kv-store", f"{args.store_size:g}"]
        stack = Stack(f"kv-tiers-{mode}", args.model, up, extra, {}, log_dir)
        print(f"{mode}: starting", flush=True)
        stack.start(timeout=600)
        try:
            results[mode] = asyncio.run(run(stack, args, vocab))
        finally:
            stack.stop()
        r = results[mode]
        print(f"{mode:5}: later-turn TTFT p50 {r['later_turn_ttft_p50_ms']:.0f} ms, p99 "
              f"{r['later_turn_ttft_p99_ms']:.0f} ms; prompt tokens computed {r['later_turn_prompt_tokens_computed']:.0f}"
              f", restored {r['later_turn_tokens_restored']:.0f}"
              + (f" at {r['restore_gb_per_s']:.2f} GB/s" if r["restore_gb_per_s"] else ""), flush=True)
    first = next(iter(results.values()))["replies"]
    same = all(r["replies"] == first for r in results.values())
    summary = {mode: {k: v for k, v in r.items() if k != "replies"} for mode, r in results.items()}
    if "off" in summary:
        off = summary["off"]
        for mode, s in summary.items():
            if mode != "off":
                s["ttft_p50_ratio_off_over_this"] = off["later_turn_ttft_p50_ms"] / s["later_turn_ttft_p50_ms"]
                computed = s["later_turn_prompt_tokens_computed"]
                s["prompt_tokens_ratio_off_over_this"] = (off["later_turn_prompt_tokens_computed"] / computed
                                                          if computed else None)
    output = args.output or (RESULTS / "kv_tiers.json" if not args.quick else log_dir / "kv_tiers.json")
    report = {"benchmark": "kv_tiers", "command": "python benchmarks/kv_tiers.py " + " ".join(sys.argv[1:]),
              "config": {**{k: v for k, v in vars(args).items() if k not in ("output", "model")},
                         "model": Path(args.model).name, "pool_blocks_per_engine": pool_blocks,
                         "working_set_blocks": working_blocks},
              "machine": machine(), "same_replies_in_every_mode": same, "summary": summary,
              "vllm": "not run: vLLM's KV offloading supports CUDA-alike and XPU GPUs only (vllm/v1/kv_offload/cpu/spec.py)"}
    output.write_text(json.dumps(report, indent=1) + "\n")
    plot(summary, output.with_suffix(".png"))
    print(f"same replies in every mode: {same}; wrote {output}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
