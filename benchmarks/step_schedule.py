"""Step schedules of an all-at-once burst under each step budget policy, without a model or a clock.

The engine's own scheduler and block manager run the workload of `serving_vs_vllm.py` at rate inf (N
prompts of L random tokens, M output tokens, EOS ignored, every request queued before the first step)
with a stand-in for the model: every finished prompt or decode gets a token. What comes out is exact and
deterministic: the step each request gets its first token in, and each step's decode and prompt tokens.

Times are an estimate on top of that, from a linear model of a step's time on a CPU:
    seconds = overhead + prompt_tokens * prefill_cost + decode_tokens * decode_cost
whose defaults are fitted to the 2-core AVX2 run in benchmarks/results/avx2/serving_vs_vllm_after.md
(a 2048-token prefill step ~2.8 s, a step of 64 decodes ~0.25 s, 43 s for the whole unified run), or,
with --calibrate, fitted here to the offline engine's own steps on --model (prefill-only steps of 256 to
2048 tokens, decode-only steps of 16 and 64 sequences, --threads compute threads); TTFT and
TPOT are computed from it as `vllm bench serve` computes them (TPOT: (end - first token) / (M - 1); p50:
the median over requests). Wall clock - with the proxy, the HTTP client and the arrivals - is
serving_vs_vllm.py's to measure.

    .venv/bin/python benchmarks/step_schedule.py                          # 64 x 128/128, budgets 512-2048
    .venv/bin/python benchmarks/step_schedule.py --calibrate --threads 2  # the cost model measured here (~2 min)
    .venv/bin/python benchmarks/step_schedule.py --input-len 200 --budgets 2048 --out-dir /tmp
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class CostModel:
    overhead: float = 0.04  # seconds a step costs whatever it computes
    prefill_cost: float = 1.33e-3  # seconds per prompt token
    decode_cost: float = 3.3e-3  # seconds per decode token

    def seconds(self, prompt_tokens: int, decode_tokens: int) -> float:
        return self.overhead + prompt_tokens * self.prefill_cost + decode_tokens * self.decode_cost


def _median_step_seconds(engine, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (tokens, seconds): (intercept, slope)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def calibrate(model: str, threads: int, prompt_len: int = 128, repeats: int = 3) -> tuple[CostModel, dict]:
    """Time the offline engine's prefill-only and decode-only steps on `model` and fit the cost model:
    the decode steps give the overhead and the decode cost, the prefill steps the prefill cost."""
    import random

    import torch

    from epdserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, enable_prefix_caching=False, max_num_batched_tokens=2048, max_num_seqs=128)
    engine, rng, ids = llm.engine, random.Random(0), iter(range(1 << 30))
    vocab = engine.model_config.vocab_size

    def queue(n: int, length: int, max_tokens: int) -> None:
        for _ in range(n):
            engine.add_request(str(next(ids)), {"prompt_token_ids": [rng.randrange(100, vocab - 100)
                                                                     for _ in range(length)]},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    queue(4, prompt_len, 2)  # warm-up: kernels, buffers
    drain()
    prefill = []
    for tokens in (256, 512, 1024, 2048):
        times = []
        for _ in range(repeats):
            queue(tokens // prompt_len, prompt_len, 1)  # one step computes them all, and they end in it
            times.append(_median_step_seconds(engine, 1))
            drain()
        prefill.append((tokens, statistics.median(times)))
    decode = []
    for seqs in (16, 64):
        queue(seqs, 16, 2 + repeats)
        engine.step()  # their prompts
        decode.append((seqs, _median_step_seconds(engine, repeats)))
        drain()
    overhead, decode_cost = _fit(decode)
    _, prefill_cost = _fit(prefill)
    measured = {"model": model, "threads": threads, "prefill_steps": prefill, "decode_steps": decode}
    return CostModel(max(overhead, 0.0), prefill_cost, decode_cost), measured


def schedule_burst(policy: str, budget: int, num_prompts: int, input_len: int, output_len: int,
                   max_num_seqs: int, first_step_prompts: int | None = None,
                   block_size: int = 16) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """Run the burst through the engine's scheduler: each step's (decode tokens, prompt tokens), and each
    request's steps with a token (1-based). `first_step_prompts`: only that many are queued before the
    first step, the others before the second (a burst that reaches the engine while it starts)."""
    from epdserve.shared.config import SchedulerConfig
    from epdserve.shared.engine.block_manager import BlockManager
    from epdserve.shared.engine.request import Request
    from epdserve.shared.engine.sampling_params import SamplingParams
    from epdserve.shared.engine.scheduler import Scheduler

    per_request = -(-(input_len + output_len) // block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, policy),
                      BlockManager(num_prompts * per_request, block_size))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    # Distinct first tokens: no prefix hits, as random prompts have none.
    requests = [Request(str(i), [1000 + i] + [i % 97] * (input_len - 1), params, max_model_len=input_len + output_len)
                for i in range(num_prompts)]
    early = num_prompts if first_step_prompts is None else first_step_prompts
    for r in requests[:early]:
        sched.add_request(r)
    steps: list[tuple[int, int]] = []
    token_steps: dict[int, list[int]] = {i: [] for i in range(num_prompts)}
    while sched.num_unfinished or not steps:
        out = sched.schedule()
        if not steps:
            for r in requests[early:]:
                sched.add_request(r)
        decodes = sum(n for r, n in out.scheduled if r.num_output_tokens)
        steps.append((decodes, out.num_batched_tokens - decodes))
        for r in sched.update_from_output(out, {r.request_id: [7] for r, _ in out.scheduled}):
            token_steps[int(r.request_id)].append(len(steps))
    return steps, token_steps


def summarize(policy: str, budget: int, args: argparse.Namespace, cost: CostModel,
              first_step_prompts: int | None = None) -> dict:
    steps, token_steps = schedule_burst(policy, budget, args.num_prompts, args.input_len, args.output_len,
                                        args.max_num_seqs, first_step_prompts)
    ends, t = [], 0.0
    for decodes, prompt in steps:
        t += cost.seconds(prompt, decodes)
        ends.append(t)
    first = [token_steps[i][0] for i in range(args.num_prompts)]
    ttft = [ends[s - 1] for s in first]
    tpot = [(ends[token_steps[i][-1] - 1] - ends[token_steps[i][0] - 1]) / max(args.output_len - 1, 1)
            for i in range(args.num_prompts)]
    prefill_steps = max(first)
    return {
        "policy": policy, "budget": budget,
        "first_token_step": first,
        "first_token_step_p50": statistics.median(first),
        "first_token_step_mean": statistics.mean(first),
        "prefill_steps": steps[:prefill_steps],  # (decode tokens, prompt tokens) until the last first token
        "max_decode_gap_steps": max((b - a for s in token_steps.values() for a, b in zip(s, s[1:])), default=0),
        "num_steps": len(steps),
        "est_ttft_p50_ms": 1000 * statistics.median(ttft),
        "est_ttft_mean_ms": 1000 * statistics.mean(ttft),
        "est_tpot_p50_ms": 1000 * statistics.median(tpot),
        "est_output_throughput": args.num_prompts * args.output_len / ends[-1],
    }


# How many prompts reach the engine before its first step (a burst's requests arrive while it starts):
# the TTFT p50 of a burst is quantized by where the step boundaries fall, which this moves.
ARRIVALS = (1, 2, 4, 8, 12, 16)


def markdown(rows: list[dict], arrivals: dict[tuple[str, int], dict[int, float]], args: argparse.Namespace,
             cost: CostModel) -> str:
    arrival = "all queued before the first step" if args.first_step_prompts is None else \
        f"{args.first_step_prompts} queued before the first step, the others before the second"
    lines = [
        "# Step schedules of an all-at-once burst, by step budget policy",
        "",
        f"`benchmarks/step_schedule.py`: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} "
        f"output tokens, {arrival}; max_num_seqs {args.max_num_seqs}. Steps are the "
        "engine scheduler's own (exact); times are estimates from a linear step cost model "
        f"(overhead {cost.overhead * 1000:.3g} ms + {cost.prefill_cost * 1000:.3g} ms per prompt token + "
        f"{cost.decode_cost * 1000:.3g} ms per decode token; "
        + (f"fitted to the offline engine's steps on {Path(args.model).name} with {args.threads} threads here)."
           if args.calibrate else "fitted to a 2-core AVX2 serving run, see the script's docstring)."),
        "",
        "| policy | budget | first-token step p50 | mean | steps with prompts (decode+prompt tokens) | "
        "max steps between tokens | est. TTFT p50 ms | est. TTFT mean ms | est. TPOT p50 ms | est. out tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shown = ", ".join(f"{d}+{p}" for d, p in r["prefill_steps"][:6]) + (", ..." if len(r["prefill_steps"]) > 6 else "")
        lines.append(f"| {r['policy']} | {r['budget']} | {r['first_token_step_p50']:g} | "
                     f"{r['first_token_step_mean']:.2f} | {len(r['prefill_steps'])}: {shown} | "
                     f"{r['max_decode_gap_steps']} | {r['est_ttft_p50_ms']:.0f} | {r['est_ttft_mean_ms']:.0f} | "
                     f"{r['est_tpot_p50_ms']:.0f} | {r['est_output_throughput']:.0f} |")
    lines += ["", "Est. TTFT p50 ms when only K prompts are queued before the first step, the others before the "
                  "second:", "",
              "| policy | budget | " + " | ".join(f"K={k}" for k in ARRIVALS) + " | mean |",
              "|---|---|" + "---|" * (len(ARRIVALS) + 1)]
    for (policy, budget), by_k in arrivals.items():
        lines.append(f"| {policy} | {budget} | " + " | ".join(f"{by_k[k]:.0f}" for k in ARRIVALS) +
                     f" | {statistics.mean(by_k.values()):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from epdserve.shared.config import BUDGET_POLICIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(BUDGET_POLICIES))
    p.add_argument("--budgets", default="512,1024,2048", help="max_num_batched_tokens values")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--first-step-prompts", type=int, metavar="K",
                   help="only K prompts queued before the first step, the rest before the second (default: all)")
    p.add_argument("--overhead-ms", type=float, default=CostModel.overhead * 1000)
    p.add_argument("--prefill-ms-per-token", type=float, default=CostModel.prefill_cost * 1000)
    p.add_argument("--decode-ms-per-token", type=float, default=CostModel.decode_cost * 1000)
    p.add_argument("--calibrate", action="store_true",
                   help="fit the cost model to the offline engine's steps on --model here (overrides the three above)")
    p.add_argument("--model", help="with --calibrate: model folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--threads", type=int, default=2, help="with --calibrate: compute threads (default: %(default)s)")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    cost = CostModel(args.overhead_ms / 1000, args.prefill_ms_per_token / 1000, args.decode_ms_per_token / 1000)
    measured = None
    if args.calibrate:
        if args.model is None:
            from epdserve.shared.checkpoints.default_model import prepare_default_model

            args.model = str(prepare_default_model())
        cost, measured = calibrate(args.model, args.threads)
    runs = [(policy, int(budget)) for budget in args.budgets.split(",") for policy in args.policies.split(",")]
    rows = [summarize(policy, budget, args, cost, args.first_step_prompts) for policy, budget in runs]
    arrivals = {run: {k: summarize(*run, args, cost, k)["est_ttft_p50_ms"] for k in ARRIVALS
                      if k <= args.num_prompts} for run in runs}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_schedule.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out_dir"}, "cost_model": asdict(cost),
                                                         "calibration": measured, "rows": rows,
                                                         "est_ttft_p50_ms_by_first_step_prompts":
                                                             {f"{p} {b}": v for (p, b), v in arrivals.items()}},
                                                        indent=1))
    text = markdown(rows, arrivals, args, cost)
    (out / "step_schedule.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
