"""The KV-aware router at scale, without engines: decision latency and index memory.

A simulated fleet of `--instances` engine instances holds `--blocks` cached blocks in all, reported as
KV events into the proxy's PrefixIndex. Multi-turn chats are replayed against it: each conversation
opens with one of `--system-prompts` shared system prompts (Zipf-distributed popularity, as real
traffic reuses a few templates most), then grows by a user turn and a reply per request. A decision is
what the proxy does per request: hash the prompt's full blocks (block_hash.py), look them up in the
index, and pick the cheapest instance (kv_routing.pick) among all of them. After each decision the
chosen instance "caches" the conversation, as its engine's events would report, and evicts its oldest
blocks when it is over its share, so the index stays at `--blocks`. With `--tier-factor F`, each
instance also has an offload tier of F pools that its evicted blocks go to (reported as the tier's KV
events), and a decision counts tier blocks at `--tier-weight` (PrefixIndex.match_weighted).

    python benchmarks/router_sim.py                     # 1,000 instances, 1,000,000 blocks
    python benchmarks/router_sim.py --tier-factor 4     # and 4,000,000 more in offload tiers
    python benchmarks/router_sim.py --instances 100 --blocks 100000 --decisions 2000

Reports decision latency p50/p90/p99 (median of --repeats runs), index memory (tracemalloc: what the
index allocated; and the index's own estimate), and how often a later turn went to the instance that
held its conversation. Writes results/router_sim.json (and .png with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.services.proxy.kv_routing import pick
from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.shared.block_hash import extend_block_hashes

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16


@dataclass
class SimStatus:
    num_free_blocks: int


@dataclass(eq=False)
class SimInstance:
    """What kv_routing.pick reads of a router Instance."""
    address: str
    load: int
    status: SimStatus
    held: deque  # its cached block hashes, oldest first
    seq: int = 0
    tier: deque = field(default_factory=deque)  # blocks its pool evicted into its offload tier, oldest first


class Workload:
    """Conversations over shared system prompts; each request is the conversation so far."""

    def __init__(self, rng: random.Random, system_prompts: int, system_len: int, turn_len: int, reply_len: int,
                 max_turns: int) -> None:
        self.rng = rng
        self.systems = [[rng.randrange(50_000) for _ in range(system_len)] for _ in range(system_prompts)]
        self.weights = [1 / (i + 1) for i in range(system_prompts)]  # Zipf(1)
        self.turn_len, self.reply_len, self.max_turns = turn_len, reply_len, max_turns
        self.live: list[list] = []  # [tokens, turns, instance that served the last turn]

    def next_request(self) -> list:
        if not self.live or (len(self.live) < 256 and self.rng.random() < 0.3):
            system = self.rng.choices(self.systems, self.weights)[0]
            self.live.append([list(system), 0, None])
        conv = self.rng.choice(self.live)
        conv[0] = conv[0] + [self.rng.randrange(50_000) for _ in range(self.turn_len)]
        conv[1] += 1
        return conv

    def finish(self, conv: list, instance: SimInstance) -> None:
        conv[0] = conv[0] + [self.rng.randrange(50_000) for _ in range(self.reply_len)]
        conv[2] = instance
        if conv[1] >= self.max_turns:
            self.live.remove(conv)


def fill(index: PrefixIndex, instances: list[SimInstance], per_instance: int, rng: random.Random) -> None:
    """Each instance starts holding `per_instance` blocks of unrelated earlier traffic."""
    for inst in instances:
        blocks = [rng.getrandbits(128).to_bytes(16, "little") for _ in range(per_instance)]
        inst.held.extend(blocks)
        inst.seq += 1
        index.apply(inst.address, inst.seq, inst.seq, blocks, ())


def cache_on(index: PrefixIndex, inst: SimInstance, hashes: list[bytes], per_instance: int, per_tier: int) -> None:
    """The chosen instance's KV events after serving: the conversation's blocks stored, its oldest
    blocks evicted to stay at its share - into its offload tier (at most `per_tier` blocks; 0: none)."""
    held = set(inst.held)
    stored = [h for h in hashes if h not in held]
    inst.held.extend(stored)
    removed = [inst.held.popleft() for _ in range(max(0, len(inst.held) - per_instance))]
    tier_stored = removed if per_tier else []
    inst.tier.extend(tier_stored)
    tier_removed = [inst.tier.popleft() for _ in range(max(0, len(inst.tier) - per_tier))]
    inst.seq += 1
    index.apply(inst.address, inst.seq, inst.seq, stored, removed, tier_stored=tier_stored, tier_removed=tier_removed)


def run(args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    per_instance = args.blocks // args.instances
    per_tier = int(per_instance * args.tier_factor)
    tracemalloc.start()
    index = PrefixIndex(max_blocks_per_instance=2 * max(per_instance, per_tier))
    instances = [SimInstance(f"tcp://10.0.{i // 250}.{i % 250}:7000", rng.randrange(8),
                             SimStatus(rng.randrange(64, 4096)), deque()) for i in range(args.instances)]
    fill(index, instances, per_instance, rng)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    workload = Workload(rng, args.system_prompts, args.system_len, args.turn_len, args.reply_len, args.max_turns)
    latencies, followed, later_turns = [], 0, 0
    for _ in range(args.decisions):
        conv = workload.next_request()
        tokens = conv[0]
        started = time.perf_counter()
        hashes = extend_block_hashes([], tokens, BLOCK_SIZE)
        chosen, _ = pick(instances, index.match_weighted(hashes, args.tier_weight)[0], len(hashes), args.load_weight)
        latencies.append(time.perf_counter() - started)
        if conv[1] > 1:
            later_turns += 1
            followed += chosen is conv[2]
        cache_on(index, chosen, hashes, per_instance, per_tier)
        chosen.load = max(0, chosen.load + rng.choice((-1, 0, 1)))  # queues drift
        workload.finish(conv, chosen)
    latencies.sort()
    q = lambda p: latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1e3  # noqa: E731
    return {"p50_ms": q(50), "p90_ms": q(90), "p99_ms": q(99), "max_ms": latencies[-1] * 1e3,
            "index_tracemalloc_mb": index_bytes / 2**20, "index_estimate_mb": index.memory_bytes() / 2**20,
            "later_turns_to_their_instance": followed / max(later_turns, 1),
            "mean_prompt_blocks": statistics.fmean(len(c[0]) // BLOCK_SIZE for c in workload.live or [[[]]])}


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    keys = ["p50_ms", "p90_ms", "p99_ms"]
    ax.bar(keys, [statistics.median(r[k] for r in runs) for k in keys])
    ax.axhline(1.0, color="red", linestyle="--", label="1 ms")
    ax.set_ylabel("decision latency (ms)")
    ax.set_title("KV-aware router decision, simulated fleet")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="cached blocks across the fleet")
    parser.add_argument("--decisions", type=int, default=5000, help="requests routed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=50)
    parser.add_argument("--system-len", type=int, default=512, help="tokens of each shared system prompt")
    parser.add_argument("--turn-len", type=int, default=128, help="tokens of each user turn")
    parser.add_argument("--reply-len", type=int, default=128, help="tokens of each reply")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--load-weight", type=float, default=0.25)
    parser.add_argument("--tier-factor", type=float, default=0.0,
                        help="each instance's offload tier, in pools: evicted blocks go there (0: no tiers)")
    parser.add_argument("--tier-weight", type=float, default=0.8, help="a tier block's worth against a pool block")
    parser.add_argument("--output", type=Path, default=RESULTS / "router_sim.json")
    args = parser.parse_args()

    runs = [run(args, seed) for seed in range(args.repeats)]
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    report = {"benchmark": "router_sim", "command": "python benchmarks/" + " ".join(Path(a).name if i == 0 else a
                                                                                    for i, a in enumerate(sys.argv)),
              "statistic": f"median of {args.repeats} runs", "config": {k: v for k, v in vars(args).items()
                                                                          if k != "output"},
              "machine": {"python": platform.python_version(), "platform": platform.platform()},
              "summary": summary, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.instances} instances, {args.blocks} blocks: decision p50 {summary['p50_ms']:.3f} ms, "
          f"p90 {summary['p90_ms']:.3f} ms, p99 {summary['p99_ms']:.3f} ms; index "
          f"{summary['index_tracemalloc_mb']:.0f} MB (estimate {summary['index_estimate_mb']:.0f} MB); "
          f"later turns to the instance holding them: {summary['later_turns_to_their_instance']:.0%}")
    if plot(runs, args.output.with_suffix(".png")):
        print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    else:
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
