"""Multi-turn chats on disaggregated stacks, routed by the KV-aware policy and by load, in one run.

Each conversation opens with a document of its own (`--doc-len` tokens), then `--turns` user turns of
`--turn-len` tokens, each answered by the server (`--reply-len` tokens, greedy, EOS ignored) before the
next is sent with the whole history: every later turn's prompt is the turn before plus its reply plus
the new user turn. Prompts are token ids sent to /v1/completions, so both policies see byte-identical
prompts. Conversations run `--conversations` at a time, turn by turn (all first turns, then all second
turns, ...), so the KV bytes the decodes pulled during one wave (`kv_transfer_bytes_total` summed over
every decode) belong to that wave's turns exactly.

For each topology (1 prefill + 2 decodes, 2 prefills + 2 decodes) and policy (`--routing-policy load`,
the baseline, and `kv`) a stack is started with `epdserve up`; each runs `--repeats` rounds with fresh
conversations (a new seed: nothing of one round is cached for the next). Reported per topology: KV bytes
pulled per later turn and later-turn TTFT p50 (median over rounds) for each policy, their ratios, and
whether every reply was the same token for token under both policies.

    python benchmarks/kv_routing.py                   # JSON + PNG in benchmarks/results/
    python benchmarks/kv_routing.py --repeats 1 --conversations 2 --turns 3
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
TOPOLOGIES = {"1P+2D": (1, 2), "2P+2D": (2, 2)}
POLICIES = ("load", "kv")


def decode_bytes(stack: Stack) -> float:
    """KV bytes every decode of the stack has pulled so far."""
    total = 0.0
    for name, port in stack.http_ports().items():
        if not name.startswith("decode"):
            continue
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("epdserve:kv_transfer_bytes_total"))
    return total


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
            chunk = json.loads(line[6:])
            got = chunk["choices"][0].get("logprobs", {}) or {}
            if got.get("tokens"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                tokens += [int(t.removeprefix("token_id:")) for t in got["tokens"]]
    return ttft, tokens


async def run_round(stack: Stack, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = 49152  # SmolLM2's; ids past a few hundred are ordinary tokens
    history = [[rng.randrange(300, vocab) for _ in range(args.doc_len)] for _ in range(args.conversations)]
    waves, replies = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(stack.url + "/v1/models")).json()["data"][0]["id"]
        for t in range(args.turns):
            for conv in history:
                conv += [rng.randrange(300, vocab) for _ in range(args.turn_len)]
            before = decode_bytes(stack)
            results = await asyncio.gather(*(turn(client, stack.url, model, conv, args.reply_len) for conv in history))
            pulled = decode_bytes(stack) - before
            for conv, (_, reply) in zip(history, results):
                conv += reply
            replies.append([reply for _, reply in results])
            waves.append({"turn": t + 1, "kv_bytes": pulled, "ttft_s": [ttft for ttft, _ in results]})
    later = waves[1:]
    return {"seed": seed, "waves": waves, "replies": replies,
            "kv_bytes_per_later_turn": sum(w["kv_bytes"] for w in later) / (len(later) * args.conversations),
            "later_turn_ttft_p50_s": statistics.median(t for w in later for t in w["ttft_s"])}


def measure(args: argparse.Namespace, model: str, log_dir: Path) -> dict:
    out: dict = {}
    for topology, (prefills, decodes) in TOPOLOGIES.items():
        for policy in POLICIES:
            name = f"{topology}-{policy}"
            stack = Stack(name, model, ["--prefills", str(prefills), "--decodes", str(decodes), "--threads", "1",
                                        "--routing-policy", policy],
                          ["--num-kv-blocks", str(args.num_kv_blocks)], {}, log_dir)
            print(f"{name}: starting", flush=True)
            stack.start(timeout=600)
            try:
                rounds = [asyncio.run(run_round(stack, args, seed)) for seed in range(args.repeats)]
            finally:
                stack.stop()
            out[name] = rounds
            print(f"{name}: KV bytes per later turn "
                  f"{statistics.median(r['kv_bytes_per_later_turn'] for r in rounds) / 2**20:.1f} MiB, later-turn "
                  f"TTFT p50 {statistics.median(r['later_turn_ttft_p50_s'] for r in rounds) * 1e3:.0f} ms", flush=True)
    return out


def summarize(runs: dict) -> dict:
    summary = {}
    for topology in TOPOLOGIES:
        load, kv = runs[f"{topology}-load"], runs[f"{topology}-kv"]
        med = lambda rounds, key: statistics.median(r[key] for r in rounds)  # noqa: E731
        bytes_load, bytes_kv = med(load, "kv_bytes_per_later_turn"), med(kv, "kv_bytes_per_later_turn")
        ttft_load, ttft_kv = med(load, "later_turn_ttft_p50_s"), med(kv, "later_turn_ttft_p50_s")
        summary[topology] = {
            "load_kv_mib_per_later_turn": bytes_load / 2**20, "kv_kv_mib_per_later_turn": bytes_kv / 2**20,
            # None where kv routing pulled nothing at all (every later turn prefilled on its decode).
            "bytes_ratio_load_over_kv": bytes_load / bytes_kv if bytes_kv else None,
            "load_later_ttft_p50_ms": ttft_load * 1e3, "kv_later_ttft_p50_ms": ttft_kv * 1e3,
            "ttft_ratio_load_over_kv": ttft_load / ttft_kv,
            "same_replies": all(a["replies"] == b["replies"] for a, b in zip(load, kv)),
        }
    return summary


def _ratio(value: float | None) -> str:
    return "all" if value is None else f"{value:.1f}x"


def plot(summary: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(summary)
    for i, policy in enumerate(POLICIES):
        xs = [j + (i - 0.5) * 0.35 for j in range(len(names))]
        left.bar(xs, [summary[n][f"{policy}_kv_mib_per_later_turn"] for n in names], 0.35, label=policy)
        right.bar(xs, [summary[n][f"{policy}_later_ttft_p50_ms"] for n in names], 0.35, label=policy)
    for ax, title in ((left, "KV pulled per later turn (MiB)"), (right, "later-turn TTFT p50 (ms)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    parser.add_argument("--conversations", type=int, default=4, help="conversations at a time")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--turn-len", type=int, default=64)
    parser.add_argument("--reply-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per stack (fresh conversations each)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="per engine")
    parser.add_argument("--output", type=Path, default=RESULTS / "kv_routing.json")
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be at least 2: later turns are what is measured")
    if args.model is None:
        from epdserve.shared.checkpoints.default_model import prepare_default_model
        args.model = str(prepare_default_model())
    log_dir = Path(tempfile.mkdtemp(prefix="kv-routing-logs-"))
    print(f"stack logs in {log_dir}", flush=True)
    runs = measure(args, args.model, log_dir)
    summary = summarize(runs)
    report = {"benchmark": "kv_routing", "command": "python benchmarks/kv_routing.py " + " ".join(sys.argv[1:]),
              "statistic": f"median of {args.repeats} rounds per stack",
              "config": {**{k: v for k, v in vars(args).items() if k not in ("output", "model")},
                         "model": Path(args.model).name},
              "machine": machine(), "summary": summary,
              "runs": {name: [{k: v for k, v in r.items() if k != "replies"} for r in rounds]
                       for name, rounds in runs.items()}}
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    for topology, s in summary.items():
        print(f"{topology}: KV per later turn {s['load_kv_mib_per_later_turn']:.2f} MiB (load) vs "
              f"{s['kv_kv_mib_per_later_turn']:.2f} MiB (kv): "
              f"{_ratio(s['bytes_ratio_load_over_kv'])} less; later-turn "
              f"TTFT p50 {s['load_later_ttft_p50_ms']:.0f} vs {s['kv_later_ttft_p50_ms']:.0f} ms: "
              f"{s['ttft_ratio_load_over_kv']:.2f}x; same replies: {s['same_replies']}")
    drawn = plot(summary, args.output.with_suffix(".png"))
    print(f"wrote {args.output}" + (f" and {args.output.with_suffix('.png')}" if drawn else ""))


if __name__ == "__main__":
    main()
