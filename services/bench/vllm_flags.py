"""The `vllm bench serve` flags, datasets and backends that `epdserve bench serve` does not have, each with why.

A saved vLLM command line either runs the same workload here or stops at once on one line naming what
cannot be honoured: a flag that was accepted and then ignored would measure something else than the
numbers say.
"""
from __future__ import annotations

import argparse

_SONNET = "vLLM's sonnet dataset, which is not available here"
_HF = "vLLM's hf datasets (Hugging Face hub sets), which are not available here"
_RANDOM_MM = ("vLLM's random-mm dataset, which is not available here: --dataset-name image sends generated images "
              "(--images-per-request, --image-width, --image-height)")
_PREFIX_REPETITION = ("vLLM's prefix_repetition dataset, which is not available here: --random-prefix-len gives "
                      "every random prompt one shared prefix")

# flag -> why it is refused. Flags of vLLM's other datasets are refused even with --dataset-name random,
# where vLLM leaves them unread: here they can only be a mistake.
REFUSED_FLAGS: dict[str, str] = {
    "--profile": "it starts vLLM's torch profiler through /start_profile, which epdserve's proxy does not have",
    "--use-beam-search": "this client sends no beam-search requests",
    "--self-timed": "it replays vLLM's timed_trace dataset, which is not available here",
    "--probe-request-rate": "no probe requests are sent beside the workload here",
    "--lora-modules": "every request here names one model: give an adapter's name as --served-model-name",
    "--lora-assignment": "every request here names one model: give an adapter's name as --served-model-name",
    "--ramp-up-strategy": "there is no ramp-up here: several --request-rate values run one after another",
    "--ramp-up-start-rps": "there is no ramp-up here: several --request-rate values run one after another",
    "--ramp-up-end-rps": "there is no ramp-up here: several --request-rate values run one after another",
    "--chat-template-kwargs": ("no dataset here renders a chat template on the client; for the server's template "
                               "use --extra-body '{\"chat_template_kwargs\": {...}}'"),
    "--skip-chat-template": "no dataset here renders a chat template on the client",
    "--plot-timeline": "the HTML timeline is vLLM's; this writes PNG latency plots beside the JSON",
    "--timeline-itl-thresholds": "the HTML timeline is vLLM's; this writes PNG latency plots beside the JSON",
    "--plot-dataset-stats": "the dataset statistics figure is vLLM's; this writes PNG latency plots beside the JSON",
    "--no-stream": f"it is read by {_HF}",
    "--hf-subset": f"it is read by {_HF}",
    "--hf-split": f"it is read by {_HF}",
    "--hf-name": f"it is read by {_HF}",
    "--hf-output-len": f"it is read by {_HF}",
    "--blazedit-min-distance": f"it is read by {_HF}",
    "--blazedit-max-distance": f"it is read by {_HF}",
    "--custom-output-len": "it is read by vLLM's custom dataset, which is not available here",
    "--spec-bench-output-len": "it is read by vLLM's spec_bench dataset, which is not available here",
    "--spec-bench-category": "it is read by vLLM's spec_bench dataset, which is not available here",
    "--sonnet-input-len": f"it is read by {_SONNET}",
    "--sonnet-output-len": f"it is read by {_SONNET}",
    "--sonnet-prefix-len": f"it is read by {_SONNET}",
    "--txt-slices-input-len": "it is read by vLLM's txt-slices dataset, which is not available here",
    "--txt-slices-output-len": "it is read by vLLM's txt-slices dataset, which is not available here",
    "--random-batch-size": "it batches prompts for vLLM's embeddings benchmark; this one measures generation",
    "--no-reranker": "it is read by vLLM's random-rerank dataset, which is not available here",
    "--random-mm-base-items-per-request": f"it is read by {_RANDOM_MM}",
    "--random-mm-num-mm-items-range-ratio": f"it is read by {_RANDOM_MM}",
    "--random-mm-limit-mm-per-prompt": f"it is read by {_RANDOM_MM}",
    "--random-mm-bucket-config": f"it is read by {_RANDOM_MM}",
    "--prefix-repetition-prefix-len": f"it is read by {_PREFIX_REPETITION}",
    "--prefix-repetition-suffix-len": f"it is read by {_PREFIX_REPETITION}",
    "--prefix-repetition-num-prefixes": f"it is read by {_PREFIX_REPETITION}",
    "--prefix-repetition-output-len": f"it is read by {_PREFIX_REPETITION}",
}

# vLLM's other --dataset-name values -> why.
REFUSED_DATASETS: dict[str, str] = {
    "random-mm": _RANDOM_MM,
    "sonnet": _SONNET,
    "hf": _HF,
    "prefix_repetition": _PREFIX_REPETITION,
    "burstgpt": "vLLM's burstgpt dataset (a trace of BurstGPT's request lengths), which is not available here",
    "custom": "vLLM's custom dataset (a JSONL file of prompts), which is not available here",
    "spec_bench": "vLLM's spec_bench dataset, which is not available here",
    "txt-slices": "vLLM's txt-slices dataset, which is not available here",
    "random-rerank": "vLLM's random-rerank dataset, for rerankers; this benchmark measures generation",
    "timed_trace": "vLLM's timed_trace dataset, which is not available here",
}

# --backend: what each of vLLM's names that we take sends here. vLLM's others (audio, embeddings, pooling,
# rerank) measure APIs epdserve does not serve.
BACKENDS: dict[str, str] = {
    "openai": "completions",
    "vllm": "completions",  # vLLM's name for the same request function as openai
    "openai-chat": "chat",
}


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Registers every refused flag, hidden from --help: it parses (with or without values) and is then
    refused by `refusal` with its reason, instead of argparse's bare 'unrecognized arguments'."""
    for flag in REFUSED_FLAGS:
        parser.add_argument(flag, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            dest="refused_" + flag.lstrip("-").replace("-", "_"))


def refusal(args: argparse.Namespace) -> str | None:
    """The one-line refusal of the first vLLM flag, dataset or backend given that cannot be honoured, or None."""
    for flag, why in REFUSED_FLAGS.items():
        if hasattr(args, "refused_" + flag.lstrip("-").replace("-", "_")):
            return f"epdserve bench serve: {flag} is not supported: {why}"
    if args.dataset_name in REFUSED_DATASETS:
        return (f"epdserve bench serve: --dataset-name {args.dataset_name} is not supported: it is "
                f"{REFUSED_DATASETS[args.dataset_name]}")
    if args.backend is not None and args.backend not in BACKENDS:
        return (f"epdserve bench serve: --backend {args.backend} is not supported: this benchmark sends text "
                f"generation requests only (openai and vllm: /v1/completions; openai-chat: /v1/chat/completions)")
    return None
