"""The KV cache stored narrower than the model (--kv-cache-dtype): how many blocks a pool of the same memory
holds, the bytes a prompt token costs on the prefill->decode wire, the speed of one long-context stream, and
the quality against the KV cache in the model's own dtype.

For each --kv-cache-dtype (auto = the model's float32, bfloat16, fp8 = E4M3, fp8_e5m2, int8 with a scale per
token and head), one engine (LLM) on the same model:

  blocks        the pool's blocks in --pool-mib MiB (the engine's own sizing, kv_cache_budget.py)
  wire bytes    bytes per prompt token of a block as stored: what the transfer moves per token (its checksums,
                8 bytes a block and layer, aside)
  perplexity    of a fixed text that ships with Python (pydoc_data's language-reference topics, the first
                --text-tokens tokens), from its prompt logprobs
  greedy equal  64 prompts (windows of the same text), --max-tokens greedy tokens each: the share of tokens
                equal to the auto cache's at the same position, and the share of answers equal in whole
  TPOT          one stream after a --context-tokens prompt, 64 tokens, median of --repeats rounds in which every
                engine (all loaded at once) runs once

    .venv/bin/python benchmarks/kv_cache_dtype.py                     # SmolLM2 (its GGUF Q4_1), ~5 minutes
    .venv/bin/python benchmarks/kv_cache_dtype.py --model gemma3-270m

Writes benchmarks/results/kv_cache_dtype.json and .png.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DTYPES = ("auto", "bfloat16", "fp8", "fp8_e5m2", "int8")
TOPICS = ("assignment", "compound", "exceptions", "execmodel", "import", "typesseq", "naming", "numbers")


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in TOPICS)


def engine(model: str, kv_cache_dtype: str, text_ids: list[int], args):
    from epdserve import LLM

    # No prefix cache: the TPOT runs' prompts are computed each time, as their TTFT run's was.
    return LLM(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=args.pool_mib << 20, seed=0,
              max_model_len=max(len(text_ids), args.context_tokens) + 128, enable_prefix_caching=False)


def measure(llm, text_ids: list[int], prompts: list[list[int]], args) -> dict:
    """Everything but the TPOT."""
    from epdserve import SamplingParams

    cache = llm.engine.runner.kv_cache
    block_size = llm.engine.config.cache.block_size
    cell = {"stored": str(cache.dtype).removeprefix("torch."), "blocks": cache.shape[2],
            "wire_bytes_per_token": cache[:, :, 0].nbytes / block_size}

    scored = llm.generate([{"prompt_token_ids": text_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [next(iter(d.values())).logprob for d in scored.prompt_logprobs[1:]]
    cell["perplexity"] = math.exp(-sum(logprobs) / len(logprobs))

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    cell["greedy"] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    return cell


def tpot(llm, context: list[int]) -> float:
    """Seconds per output token of one stream after `context`, its time to the first token taken off."""
    from epdserve import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": context}], SamplingParams(temperature=0.0, max_tokens=1))
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": context}], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    return (time.perf_counter() - t - ttft) / 63


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model name `epdserve model` prepares, or a folder")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from epdserve.services.cli.main import prepare_model

    torch.set_num_threads(args.threads)
    model = str(prepare_model(args.model)) if not Path(args.model).is_dir() else args.model
    ids = AutoTokenizer.from_pretrained(model)(reference_text())["input_ids"]
    text_ids = ids[:args.text_tokens]
    step = max(1, (len(ids) - args.prompt_tokens) // args.prompts)
    prompts = [ids[i * step:i * step + args.prompt_tokens] for i in range(args.prompts)]

    engines = {d: engine(model, d, text_ids, args) for d in args.dtypes.split(",")}
    cells = {d: measure(llm, text_ids, prompts, args) for d, llm in engines.items()}
    # TPOT in rounds, every engine once a round: a slow stretch of the machine lands on all of them.
    context = (text_ids * (args.context_tokens // len(text_ids) + 1))[:args.context_tokens]
    runs = {d: [] for d in engines}
    for _ in range(args.repeats):
        for d, llm in engines.items():
            runs[d].append(tpot(llm, context))
    for d, cell in cells.items():
        cell["tpot_ms"] = 1e3 * statistics.median(runs[d])
        cell["tpot_ms_runs"] = [1e3 * t for t in runs[d]]
    answers = {d: cell.pop("greedy") for d, cell in cells.items()}
    base = cells["auto"]
    for d, cell in cells.items():
        pairs = [(a, b) for got, want in zip(answers[d], answers["auto"]) for a, b in zip(got, want)]
        cell["greedy_tokens_equal"] = sum(a == b for a, b in pairs) / len(pairs)
        cell["greedy_answers_equal"] = sum(g == w for g, w in zip(answers[d], answers["auto"])) / len(prompts)
        cell["blocks_vs_auto"] = cell["blocks"] / base["blocks"]
        cell["wire_vs_auto"] = cell["wire_bytes_per_token"] / base["wire_bytes_per_token"]
        cell["perplexity_vs_auto"] = cell["perplexity"] / base["perplexity"] - 1
        cell["tpot_vs_auto"] = base["tpot_ms"] / cell["tpot_ms"]
    results = {"model": args.model, "text": f"pydoc_data topics {', '.join(TOPICS)}: first {len(text_ids)} tokens",
               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_cache_dtype.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"{'kv cache':10} {'stored':14} {'blocks':>7} {'x':>5} {'B/token':>8} {'x':>5} {'ppl':>8} {'dppl':>7} "
          f"{'tok eq':>7} {'ans eq':>7} {'TPOT ms':>8} {'x':>5}")
    for d, c in cells.items():
        print(f"{d:10} {c['stored']:14} {c['blocks']:7d} {c['blocks_vs_auto']:5.2f} {c['wire_bytes_per_token']:8.0f} "
              f"{c['wire_vs_auto']:5.2f} {c['perplexity']:8.4f} {100 * c['perplexity_vs_auto']:+6.2f}% "
              f"{100 * c['greedy_tokens_equal']:6.1f}% {100 * c['greedy_answers_equal']:6.1f}% {c['tpot_ms']:8.2f} "
              f"{c['tpot_vs_auto']:5.2f}")
    plot(cells, args.out / "kv_cache_dtype.png")
    return 0


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cells)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, title in zip(axes, ("blocks_vs_auto", "perplexity_vs_auto", "tpot_vs_auto"),
                              ("pool blocks at equal memory (x auto)", "perplexity change vs auto",
                               "TPOT speed-up vs auto")):
        ax.bar(names, [cells[n][key] for n in names])
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
