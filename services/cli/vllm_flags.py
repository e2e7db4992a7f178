"""vLLM's command-line flags, as `epdserve serve` and `epdserve up` take them, so that a saved `vllm serve`
command line starts here: each flag with its meaning on this engine, and the ones that cannot apply refused in
one line that names the flag and says why.

Most of vLLM's engine flags are epdserve's own under the same name (cli_options.py: --max-model-len, --dtype,
--max-num-seqs, --block-size, ...). This module adds the rest:

    engine (serve prefill/decode/unified, up)   --tensor-parallel-size, --pipeline-parallel-size,
        --gpu-memory-utilization, --kv-cache-dtype, --quantization, --trust-remote-code, --enforce-eager,
        --enable-chunked-prefill, --tokenizer, --disable-log-requests
    proxy (serve proxy, up)                      --enable-auto-tool-choice, --chat-template,
        --limit-mm-per-prompt, --trust-remote-code, --tokenizer, --disable-log-requests
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from epdserve.shared.config import KV_CACHE_DTYPES

# vLLM's --dtype spellings -> ours. "auto" is the exact float32 here on CPU (vLLM: the checkpoint's dtype).
DTYPES = {"auto": "float32", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
MODALITIES = ("image",)
DEFAULT_BUDGET_POLICY = "prompts"  # what a prompt may carry here


def dtype(value: str) -> str:
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(DTYPES)}")
    return DTYPES[value]


def add_engine_flags(g: argparse._ActionsContainer) -> None:
    """vLLM's engine flags that have no epdserve option of the same name."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="vLLM's; 1 only: an engine runs on one device here (for more throughput, run more engines: "
                        "`up --decodes N`)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="vLLM's; 1 only, as --tensor-parallel-size")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   help="vLLM's; here the share of the memory available at start-up, after the weights, that the "
                        "KV pool takes - the same as --kv-cache-memory-fraction (vLLM: the share of the whole GPU, "
                        "weights included). On CPU each engine of a host sees the same free memory: keep it small")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="vLLM's: what the KV cache stores - auto (the model's --dtype), bfloat16, fp8 (= fp8_e4m3) "
                        "or fp8_e5m2 (unscaled, as vLLM without calibrated scales), or int8 (each token's row of each "
                        "head with its own scale); the prefill->decode transfer, the offload tier and the KV store "
                        "move blocks as stored. Every engine of a deployment must store the same"),
    g.add_argument("--quantization", "-q", metavar="METHOD",
                   help="vLLM's: gguf, a GGUF file's weights (--model FILE.gguf, or a folder holding its "
                        "model.gguf) served as they ship, which is the default for such a model; int8, a float "
                        "checkpoint's dense linear layers quantized at load, one scale per output channel (a "
                        "quarter of float32's bytes; float32 compute on the int8 values); other methods are refused")
    add_shared_flags(g)
    g.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's; always so here: the engine captures no graphs (accepted for vLLM command lines)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   help="vLLM's: on is --budget-policy shared (decodes and prompt chunks share a step's budget, the "
                        "last prompt chunked to fill it, as vLLM V1), off is --budget-policy prompts (default: "
                        "--budget-policy's)")


def add_proxy_flags(g: argparse._ActionsContainer) -> None:
    """vLLM's API server flags that have no epdserve option of the same name."""
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's; always so here: with tools and tool_choice auto (or none given), the model may "
                        "call them, read with --tool-call-parser (accepted for vLLM command lines)")
    g.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, as a file or inline, instead of the model folder's (vLLM's)")
    g.add_argument("--limit-mm-per-prompt", type=mm_limits, metavar="JSON",
                   help='most items of each modality in one prompt, vLLM\'s JSON (\'{"image": 2}\') or its older '
                        'image=2; a request with more gets a 400 (default: no limit). Modalities here: image')
    add_shared_flags(g)


def add_shared_flags(g: argparse._ActionsContainer) -> None:
    """Flags both the engines and the proxy take (`up` gives them to every service)."""
    g.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's; nothing to trust here: epdserve runs no code from a model folder, whatever "
                        "its config names (accepted for vLLM command lines)")
    g.add_argument("--tokenizer", metavar="FOLDER",
                   help="vLLM's; the model folder's only: the tokenizer is read from --model (give the model "
                        "folder, or none)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's; always so here: requests are logged one by one only at --log-level debug "
                        "(accepted for vLLM command lines)")


def mm_limits(value: str) -> dict[str, int]:
    """--limit-mm-per-prompt: '{"image": 2}' or image=2[,video=0]."""
    try:
        limits = json.loads(value) if value.lstrip().startswith("{") else {
            k.strip(): int(v) for k, _, v in (item.partition("=") for item in value.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither JSON ('{{\"image\": 2}}') nor image=2") from None
    for modality, limit in limits.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise argparse.ArgumentTypeError(f"{modality}: {limit!r} is not a count (a whole number >= 0)")
        if modality not in MODALITIES and limit:
            raise argparse.ArgumentTypeError(f"{modality}: this server takes {', '.join(MODALITIES)} only, so "
                                             f"only a limit of 0 applies to it")
    return {m: n for m, n in limits.items() if m in MODALITIES}


def check_engine_flags(args: argparse.Namespace, model: str) -> None:
    """Raises ValueError, naming the flag and why, for vLLM engine flags that cannot apply here."""
    check_shared_flags(args, model)
    for flag, size in (("--tensor-parallel-size", args.tensor_parallel_size),
                       ("--pipeline-parallel-size", args.pipeline_parallel_size)):
        if size != 1:
            raise ValueError(f"{flag} {size}: an engine runs on one device here (no model parallelism); for more "
                             "throughput run more engines (`epdserve up --decodes N`, or more decode services)")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported here; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    from epdserve.shared.models.weights import check_quantization

    check_quantization(args.quantization, model)
    if args.gpu_memory_utilization is not None and args.kv_cache_memory_fraction is not None:
        raise ValueError("--gpu-memory-utilization and --kv-cache-memory-fraction say the same here: give one")


def check_shared_flags(args: argparse.Namespace, model: str) -> None:
    if args.tokenizer is not None and Path(args.tokenizer).resolve() != Path(model).resolve():
        raise ValueError(f"--tokenizer {args.tokenizer}: the tokenizer is the model folder's here ({model}); "
                         "put the tokenizer's files into the model folder instead")


def budget_policy(args: argparse.Namespace) -> str:
    """--budget-policy (None: not given), or the one --enable-chunked-prefill / --no-enable-chunked-prefill
    names; the two contradicting is refused."""
    if args.enable_chunked_prefill is None:
        return args.budget_policy or DEFAULT_BUDGET_POLICY
    policy = "shared" if args.enable_chunked_prefill else "prompts"
    if args.budget_policy not in (None, policy):
        flag = "--enable-chunked-prefill" if args.enable_chunked_prefill else "--no-enable-chunked-prefill"
        raise ValueError(f"{flag} is --budget-policy {policy}, but --budget-policy {args.budget_policy} is given")
    return policy
