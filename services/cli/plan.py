"""`epdserve plan`: the layout (encoders, prefills, decodes; or one unified engine) a traffic needs to meet its
latency SLOs on this machine, from a profile of the model measured here (services/planner).

    epdserve plan --model M --request-rate R --input-len N --output-len N [--images-per-request K] \\
        --ttft-slo SECONDS --tpot-slo SECONDS [--max-instances N] [--save-profile FILE | --profile FILE]

Prints every layout it weighed, best first - predicted TTFT and TPOT (means, which the SLOs are held to, and
medians), goodput (the highest request rate still within both SLOs) - and the `epdserve up` command of the best;
`--output FILE` writes the same as JSON,
with the profile. A profile saved with --save-profile is read back with --profile (nothing measured then).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

DEFAULT_PROMPT_LENS = (16, 64, 256, 1024)
DEFAULT_BATCHES = (1, 4, 16, 64)


def _positive(kind: type, what: str) -> Callable[[str], float]:
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {value!r}") from None
        if not number > 0 or (kind is float and not math.isfinite(number)):
            raise argparse.ArgumentTypeError(f"{what} must be above 0, got {value}")
        return number
    return parse


def _sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(v) for v in value.split(",") if v}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, got {value!r}")
    return sizes


def add_plan_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Adds `plan` to the `epdserve` command's subparsers; `add_engine_args`: the engine's options."""
    p = subparsers.add_parser("plan", help="recommend how many encoders, prefills and decodes meet latency SLOs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder or GGUF file (default: the demo model)")
    p.add_argument("--request-rate", type=_positive(float, "--request-rate"), required=True, metavar="R",
                   help="requests per second")
    p.add_argument("--input-len", type=_positive(int, "--input-len"), required=True, metavar="N",
                   help="prompt tokens per request")
    p.add_argument("--output-len", type=_positive(int, "--output-len"), required=True, metavar="N",
                   help="output tokens per request")
    p.add_argument("--images-per-request", type=int, default=0, metavar="K")
    p.add_argument("--ttft-slo", type=_positive(float, "--ttft-slo"), required=True, metavar="SECONDS")
    p.add_argument("--tpot-slo", type=_positive(float, "--tpot-slo"), required=True, metavar="SECONDS")
    p.add_argument("--max-instances", type=_positive(int, "--max-instances"), metavar="N",
                   help="instances of every role together at most (default: this machine's cores over --threads, "
                        "at least 2)")
    p.add_argument("--profile", metavar="FILE", help="a profile --save-profile wrote: nothing is measured")
    p.add_argument("--save-profile", metavar="FILE", help="write the profile measured here to FILE")
    p.add_argument("--prompt-lens", type=_sizes, default=DEFAULT_PROMPT_LENS, metavar="N,N,...",
                   help="prompt lengths profiled, with --input-len (default: %(default)s)")
    p.add_argument("--batches", type=_sizes, default=DEFAULT_BATCHES, metavar="N,N,...",
                   help="decode batches profiled, up to --max-num-seqs (default: %(default)s)")
    p.add_argument("--output", metavar="FILE", help="write the plan (and the profile) as JSON")
    add_engine_args(p)
    p.set_defaults(func=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    from epdserve.services.planner.layout_model import SLO, Traffic
    from epdserve.services.planner.plan import plan
    from epdserve.services.planner.profile import EngineProfile

    if args.images_per_request < 0:
        raise SystemExit("epdserve: error: --images-per-request must be at least 0")
    if args.profile and args.save_profile:
        raise SystemExit("epdserve: error: --profile reads a profile and --save-profile writes one: give one")
    threads = args.threads or 1
    max_instances = args.max_instances or max(2, (os.cpu_count() or 1) // threads)
    traffic = Traffic(args.request_rate, args.input_len, args.output_len, args.images_per_request)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    if args.profile:
        try:
            profile = EngineProfile.load(args.profile)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"epdserve: error: --profile: {exc}") from None
    else:
        profile = asyncio.run(_measure(args, threads))
        if args.save_profile:
            profile.save(args.save_profile)
    try:
        ranked = plan(profile, traffic, slo, max_instances)
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None
    _print(ranked, traffic, slo, args.model or profile.model)
    if args.output:
        Path(args.output).write_text(json.dumps({
            "traffic": asdict(traffic), "slo": asdict(slo), "max_instances": max_instances,
            "profile": asdict(profile),
            "layouts": [{"layout": str(c.layout), "counts": asdict(c.layout), "ttft": c.prediction.ttft,
                         "tpot": c.prediction.tpot, "ttft_p50": c.prediction.ttft_p50,
                         "tpot_p50": c.prediction.tpot_p50, "decode_batch": c.prediction.batch, "load": c.prediction.load,
                         "goodput": c.goodput, "meets_slo": c.meets} for c in ranked]}, indent=1) + "\n")
    return 0


async def _measure(args: argparse.Namespace, threads: int):
    from epdserve.services.cli.main import engine_config, model_folder
    from epdserve.services.planner.profile import measure
    from epdserve.shared.engine import AsyncLLM

    model = model_folder(args)
    args.enable_prefix_caching = False  # every profiled prompt computed, none found cached
    try:
        config = engine_config(args, model)
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None
    limit = config.model.max_model_len
    if args.input_len + args.output_len > limit:
        raise SystemExit(f"epdserve: error: --input-len {args.input_len} + --output-len {args.output_len} exceed "
                         f"the model's context ({limit} tokens)")
    prompt_lens = sorted({n for n in (*args.prompt_lens, args.input_len) if n < limit})
    batches = sorted({b for b in args.batches if b <= config.scheduler.max_num_seqs})
    print(f"epdserve plan: profiling {Path(model).name} ({threads} thread(s)): prompts of {prompt_lens} tokens, "
          f"decode batches {batches}", file=sys.stderr)
    llm = await asyncio.to_thread(AsyncLLM.from_config, config, detokenize=False, num_threads=threads)
    try:
        encoder = _image_encoder(model, config) if args.images_per_request else None
        return await measure(llm, Path(model).name, config.model.vocab_size, threads, config.scheduler.max_num_seqs,
                             config.scheduler.max_num_batched_tokens, prompt_lens, batches,
                             args.input_len, encoder, seed=args.seed)
    finally:
        llm.shutdown()


def _image_encoder(model: str, config):
    from epdserve.services.cli.launcher import is_multimodal
    from epdserve.shared.models.image_encoder import ImageEncoder

    if not is_multimodal(model):
        raise SystemExit(f"epdserve: error: --images-per-request: {Path(model).name} takes no images")
    return ImageEncoder.from_pretrained(model, config.model.dtype, config.device)


def _seconds(value: float) -> str:
    return "overloaded" if math.isinf(value) else f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _print(ranked, traffic, slo, model: str) -> None:
    print(f"traffic: {traffic.rate:g} req/s, {traffic.input_len} in / {traffic.output_len} out tokens, "
          f"{traffic.images} image(s) per request; SLOs: TTFT {_seconds(slo.ttft)}, TPOT {_seconds(slo.tpot)}")
    print(f"{'layout':<10} {'instances':>9} {'TTFT mean':>12} {'TTFT p50':>12} {'TPOT mean':>12} {'TPOT p50':>12} "
          f"{'goodput req/s':>14}  meets SLOs")
    for c in ranked:
        p = c.prediction
        print(f"{str(c.layout):<10} {c.layout.instances:>9} {_seconds(p.ttft):>12} {_seconds(p.ttft_p50):>12} "
              f"{_seconds(p.tpot):>12} {_seconds(p.tpot_p50):>12} {c.goodput:>14.3f}  {'yes' if c.meets else 'no'}")
    best = ranked[0]
    verdict = "meets both SLOs" if best.meets else "meets no SLO pair: the closest by goodput"
    try:
        command = " ".join(["epdserve up --model", model, *best.layout.up_args()])
    except ValueError:
        command = "(a deployment with unified replicas: compose or Helm)"
    print(f"recommended: {best.layout} ({verdict}): {command}")
