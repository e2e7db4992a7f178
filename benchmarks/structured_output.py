"""What structured outputs cost: a batch constrained by a JSON schema against the same batch unconstrained,
on the offline engine (SmolLM2-135M-Instruct, float32).

Both workloads sample with the API's defaults (temperature 1.0, top_p 1.0, unseeded) from the same chat
prompts; the constrained one carries `structured_outputs` = a JSON schema of a small record (the grammar is
compiled once, in the untimed warm-up, and hit in the cache afterwards). Each repeat times one
`LLM.generate` of the batch and reads the engine's step time and the sampler's grammar time (filling
each constrained row's bitmask and applying it, plus feeding each sampled token to its matcher) over that run. Reported, as medians of `--repeats`:

  ms_per_token       wall time of the generate / output tokens
  grammar_ms_per_token   grammar time / constrained output tokens: the direct per-token overhead
  grammar_share      grammar time / engine step time (how much of a step the grammar takes)
  overhead_ms_per_token  constrained ms_per_token - unconstrained ms_per_token

The end-to-end difference also holds batch-shape effects: constrained answers end when their JSON ends, so
the batch thins out at different times than in the unconstrained run. The compile time of the schema
(once per schema, then cached) is measured on its own.

    python benchmarks/structured_output.py                            # JSON + PNG in benchmarks/results/
    python benchmarks/structured_output.py --num-requests 4 --max-tokens 16 --repeats 1 --out-dir /tmp/so
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from epdserve.shared.checkpoints.default_model import prepare_default_model
from epdserve.shared.engine.llm import LLM
from epdserve.shared.engine.sampling_params import SamplingParams, StructuredOutputsParams
from epdserve.shared.engine.structured_output import GrammarCompiler

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 40}, "hobbies": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
TOPICS = ["a pirate", "a baker", "a pilot", "a gardener", "a chess player", "a nurse", "a painter", "a sailor"]


def prompts(llm: LLM, n: int) -> list[dict]:
    tokenizer = llm.get_tokenizer()
    return [{"prompt_token_ids": tokenizer.encode_chat(
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as a JSON record."}])}
        for i in range(n)]


def run_once(llm: LLM, batch: list[dict], params: SamplingParams) -> dict:
    engine = llm.engine

    def grammar_seconds() -> float:
        return engine.runner.sampler.grammar_seconds + engine.grammar_compiler.accept_seconds

    steps_before, grammar_before = sum(engine.stats().step_seconds.values()), grammar_seconds()
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step_seconds = sum(engine.stats().step_seconds.values()) - steps_before
    grammar = grammar_seconds() - grammar_before
    valid = sum(_is_json_object(o.outputs[0].text) for o in outs) if params.structured_outputs else None
    return {"elapsed_s": elapsed, "output_tokens": tokens, "ms_per_token": 1000 * elapsed / tokens,
            "step_s": step_seconds, "grammar_s": grammar, "grammar_ms_per_token": 1000 * grammar / tokens,
            "grammar_share": grammar / step_seconds if step_seconds else 0.0, "valid_json": valid}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def compile_seconds(llm: LLM) -> float:
    """One compile of the schema from scratch (a fresh compiler; the engine's cache is not touched)."""
    engine = llm.engine
    fresh = GrammarCompiler(engine.tokenizer.hf, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
    fresh.compile(StructuredOutputsParams("regex", "x"))  # builds the tokenizer tables: not the schema's cost
    start = time.perf_counter()
    fresh.compile(StructuredOutputsParams.json_schema(SCHEMA))
    return time.perf_counter() - start


def median_of(runs: list[dict]) -> dict:
    keys = ["elapsed_s", "output_tokens", "ms_per_token", "grammar_ms_per_token", "grammar_share"]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["unconstrained", "json_schema"]
    values = [summary[n]["ms_per_token"] for n in names]
    left.bar(names, values, color=["#888888", "#3b6ea8"])
    for i, v in enumerate(values):
        left.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    left.set_ylabel("ms per output token (median)")
    left.set_title(f"batch of {summary['num_requests']}, {summary['threads']} thread(s)")
    share = 100 * summary["json_schema"]["grammar_share"]
    right.bar(["grammar", "rest of step"], [share, 100 - share], color=["#c0504d", "#bbbbbb"])
    right.set_ylabel("% of engine step time")
    right.set_title(f"grammar: {summary['json_schema']['grammar_ms_per_token']:.3f} ms / token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(prepare_default_model())
    llm = LLM(model, max_num_seqs=max(args.num_requests, 1))
    batch = prompts(llm, args.num_requests)
    workloads = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens),
        "json_schema": SamplingParams(max_tokens=args.max_tokens,
                                      structured_outputs=StructuredOutputsParams.json_schema(SCHEMA)),
    }
    for params in workloads.values():  # warm-up: allocations, and the schema compiled into the cache
        llm.generate(batch[:2], params)
    runs = {name: [] for name in workloads}
    for _ in range(args.repeats):  # alternated, so that load from elsewhere hits both alike
        for name, params in workloads.items():
            runs[name].append(run_once(llm, batch, params))
    summary = {"model": Path(model).name, "threads": args.threads, "num_requests": args.num_requests,
               "max_tokens": args.max_tokens, "repeats": args.repeats, "sampling": "temperature 1.0, top_p 1.0",
               "machine": platform.processor() or platform.machine(), "schema": SCHEMA,
               "schema_compile_s": compile_seconds(llm)}
    for name in workloads:
        summary[name] = median_of(runs[name])
    summary["overhead_ms_per_token"] = summary["json_schema"]["ms_per_token"] - summary["unconstrained"]["ms_per_token"]
    summary["valid_json"] = [r["valid_json"] for r in runs["json_schema"]]
    summary["runs"] = runs
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_output.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "structured_output.png")
    print(f"{'workload':<15} {'ms/token':>9} {'grammar ms/token':>17} {'grammar share':>14} {'tokens':>7}")
    for name in workloads:
        s = summary[name]
        print(f"{name:<15} {s['ms_per_token']:9.3f} {s['grammar_ms_per_token']:17.4f} "
              f"{100 * s['grammar_share']:13.2f}% {s['output_tokens']:7.0f}")
    print(f"end-to-end overhead {summary['overhead_ms_per_token']:+.3f} ms/token; schema compile "
          f"{1000 * summary['schema_compile_s']:.1f} ms; valid JSON per run {summary['valid_json']} "
          f"of {args.num_requests}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
