"""The `epdserve` command."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _model_command(args: argparse.Namespace) -> int:
    from epdserve.shared.default_model import default_cache_dir, prepare_default_model

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.which == "default":
        print(prepare_default_model(cache_dir))
        return 0
    if args.which == "llava-demo":
        from epdserve.shared.llava_demo import build_llava_demo

        out = Path(args.out) if args.out else cache_dir / "models" / "llava-demo"
        print(build_llava_demo(out, prepare_default_model(cache_dir), seed=args.seed))
        return 0
    from epdserve.shared.tiny_models import build_tiny_model

    out = Path(args.out) if args.out else cache_dir / "models" / f"tiny-{args.which}"
    print(build_tiny_model(args.which, out, prepare_default_model(cache_dir), seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="prepare a model folder; prints its path last")
    model.add_argument("which", choices=["default", "tiny-llama", "tiny-qwen2", "llava-demo"],
                       help="default: SmolLM2-135M-Instruct converted from its GGUF; tiny-*: random test models; "
                            "llava-demo: SmolLM2 behind an untrained CLIP vision tower (LLaVA layout)")
    model.add_argument("--cache-dir", help="where prepared models live (default: $EPDSERVE_CACHE_DIR or ~/.cache/epdserve)")
    model.add_argument("--out", help="output folder for a tiny or llava-demo model")
    model.add_argument("--seed", type=int, default=0)
    model.set_defaults(func=_model_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "which", "").startswith("tiny-"):
        args.which = args.which.removeprefix("tiny-")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
