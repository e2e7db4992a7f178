"""The options of every `epdserve` subcommand, apart from what the commands do with them (main.py)."""
from __future__ import annotations

import argparse
import os
from typing import NamedTuple

from epdserve.services.cli import vllm_flags
from epdserve.services.cli.forwarded_options import ForwardedOptions
from epdserve.services.proxy.kv_routing import RoutingPolicy
from epdserve.services.proxy.reasoning_parsers import REASONING_PARSERS as REASONING_PARSER_NAMES
from epdserve.services.proxy.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES
from epdserve.shared.config import BUDGET_POLICIES

ROLES = ("encoder", "prefill", "decode", "unified", "proxy", "kvstore", "planner")
MODELS = ("llava-demo", "smollm2", "gemma3-270m", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe",
          "tiny-mixtral", "tiny-gemma3", "tiny-qwen2.5-vl", "tiny-lora",
          "bench-qwen3-moe")
SERVED_BY_DEFAULT = "llava-demo"  # what `up` and `serve` run without --model
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SERVED_MODEL_NAME_HELP = ("the model's names in the API: the first in responses, /v1/models, the model_name label "
                          "of every metric and request traces; every one accepted as a request's \"model\" (default: "
                          "the model folder's name); give every service of a deployment the same")

# /metrics open, as vLLM's: scrapers and vLLM's dashboards and alerts expect it.
_API_KEY_SCOPE = ("It covers every route but /health and /metrics, which are open as vLLM's are (`serve proxy "
                  "--metrics-require-api-key` puts /metrics behind it)")


def port_range(value: str) -> tuple[int, int]:
    """LOW-HIGH, two ports, LOW <= HIGH."""
    low, sep, high = value.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= 65535):
        raise argparse.ArgumentTypeError(f"{value!r} is not a port range LOW-HIGH (e.g. 9100-9199)")
    return int(low), int(high)


def log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(LOG_LEVELS)}")
    return value.lower()


def add_log_level(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: given after the command it overrides `epdserve --log-level`; absent, it leaves that alone.
    p.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help="debug, info, warning, error or critical; debug adds a line per HTTP request "
                        "(default: $EPDSERVE_LOG_LEVEL or info)")


def add_model_options(model: argparse.ArgumentParser) -> None:
    model.add_argument("which", choices=MODELS,
                       help=f"{SERVED_BY_DEFAULT}: what `epdserve up` and `make run` serve without --model "
                            "(SmolLM2-135M-Instruct behind an untrained CLIP vision tower, LLaVA layout); "
                            "smollm2: SmolLM2-135M-Instruct alone, converted from its packaged GGUF; "
                            "gemma3-270m: Gemma 3 270M (pretrained, Gemma Terms of Use), converted from its "
                            "packaged GGUF; "
                            "tiny-*: random test models (tiny-lora: a LoRA adapter of tiny-llama, a PEFT folder); "
                            "bench-qwen3-moe: a larger random Qwen3-MoE for benchmarks (106M parameters: 8 layers, "
                            "hidden 512, 16 experts, top-4), which vLLM's CPU build runs too")
    model.add_argument("--cache-dir", help="where prepared models live (default: $EPDSERVE_CACHE_DIR or ~/.cache/epdserve)")
    model.add_argument("--out", help="output folder (tiny, bench and llava-demo models)")
    model.add_argument("--seed", type=int, default=0)


# Options more than one command takes: each one's type, default and values are defined once below, and each
# command says in its help what the option does there.

def add_served_model_name(p: argparse._ActionsContainer, help: str = SERVED_MODEL_NAME_HELP) -> None:
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help=help)


def add_drain_timeout(p: argparse._ActionsContainer, help: str, default: float = 10.0) -> None:
    p.add_argument("--drain-timeout", type=float, default=default, metavar="SECONDS", help=help)


def add_api_key_options(p: argparse._ActionsContainer, key_help: str, file_help: str) -> None:
    p.add_argument("--api-key", default=os.environ.get("EPDSERVE_API_KEY"), metavar="KEY", help=key_help)
    p.add_argument("--api-key-file", default=os.environ.get("EPDSERVE_API_KEY_FILE"), metavar="FILE", help=file_help)


def add_speculative_config(p: argparse._ActionsContainer, help: str) -> None:
    p.add_argument("--speculative-config", metavar="JSON", help=help)


def add_routing_policy(p: argparse._ActionsContainer, help: str) -> None:
    p.add_argument("--routing-policy", choices=[policy.value for policy in RoutingPolicy], default="kv", help=help)


def add_migration_limit(p: argparse._ActionsContainer, help: str) -> None:
    p.add_argument("--migration-limit", type=int, default=3, metavar="N", help=help)


def add_max_prefill_queue_tokens(p: argparse._ActionsContainer, help: str) -> None:
    p.add_argument("--max-prefill-queue-tokens", type=int, default=1024, metavar="TOKENS", help=help)


def add_service_ports(p: argparse._ActionsContainer, port_help: str, engine_id_help: str) -> None:
    """An engine service's or the KV store's control and management ports and its id."""
    p.add_argument("--port", type=int, default=0, help=port_help)
    p.add_argument("--http-port", type=int, default=0, help="/health, /ready, /metrics")
    p.add_argument("--engine-id", help=engine_id_help)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", type=vllm_flags.dtype, default="float32", metavar="DTYPE",
                   help="float32 (or float, or auto: exact against HF transformers in float32), bfloat16, float16 "
                        "(or half) (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=float,
                   help="KV pool size in GiB (default: sized from the memory available, see "
                        "--kv-cache-memory-fraction)")
    g.add_argument("--kv-cache-memory-fraction", type=float,
                   help="share of the memory available at start-up, after the weights, that the KV pool takes when "
                        "no size is given (default 0.05 on CPU, 0.9 on a GPU)")
    g.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GiB",
                   help="local offload tier: GiB of KV blocks kept beyond the pool once it evicts them, in a "
                        "memory-mapped file, restored on a prefix hit instead of recomputed (0: none; "
                        "default: %(default)s)")
    g.add_argument("--kv-offloading-path", metavar="DIR",
                   help="folder of the offload tier's file (each engine makes its own, removed from the folder "
                        "once mapped; default: the temp folder)")
    g.add_argument("--kv-offloading-save-finished", action=argparse.BooleanOptionalAction, default=False,
                   help="also save finished requests' full blocks to the offload tier, not only evicted ones")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="a step's token budget; what it counts is --budget-policy's (default: %(default)s)")
    g.add_argument("--budget-policy", choices=BUDGET_POLICIES,
                   help="prompts: the budget bounds a step's prompt (and draft) tokens, every running request's "
                        "next token rides on top, and waiting prompts are packed whole (one that does not fit "
                        "waits for the next step unless it is longer than the budget); shared: vLLM V1's, decodes "
                        "and prompt chunks share the budget and the last prompt is chunked to fill it "
                        f"(default: {vllm_flags.DEFAULT_BUDGET_POLICY})")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="auto: triton on CUDA, the C++ cpu kernel on CPU (torch if it cannot be built)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a request's structured output (JSON schema, regex, grammar) may take to compile "
                        "before the request is refused with a 400; compiles run off the service's event loop")
    add_speculative_config(g, help='speculative decoding, in vLLM\'s spelling: \'{"method": "ngram", '
                                   '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
                                   "(prompt lookup: drafts copied from what followed the latest earlier occurrence of "
                                   'the last tokens), "draft_model" or "suffix" (suffix decoding); each step keeps '
                                   'only the drafts worth their rows unless "adaptive": false; outputs are those of '
                                   "decoding without it, token for token (default: off)")
    g.add_argument("--threads", type=int, help="compute threads of the engine (or encoder); the service's other "
                                                "threads use one (default: one per core)")
    g.add_argument("--profile-moe", action="store_true",
                   help="time a mixture-of-experts model's sparse MLPs by part (moe_route, moe_dispatch, moe_experts, "
                        "moe_combine phases of epdserve:engine_step_seconds, taken out of forward); a few clock reads "
                        "per sparse layer and step (default: off, and nothing for a dense model)")
    add_lora_engine_args(g)
    vllm_flags.add_engine_flags(p.add_argument_group("vLLM's flags (for vLLM command lines)"))


def add_lora_engine_args(g: argparse._ActionsContainer) -> None:
    """An engine's LoRA options (`up` takes them too and passes them on)."""
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) beside the base weights; a batch mixes them")
    add_lora_modules_arg(g)
    g.add_argument("--max-loras", type=int, default=4, metavar="N",
                   help="adapters resident in the model at once; a request for another while every one is in use "
                        "is refused retryably (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="largest adapter rank served; an adapter above it is refused at load (default: %(default)s)")
    add_lora_root_arg(g)
    g.add_argument("--max-lora-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="largest adapter weights file read; a larger one is refused at load (default: %(default)s)")


def add_lora_root_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--lora-root", action="append", metavar="DIR",
                   help="a folder adapters may be loaded from at run time (repeatable; like vLLM's LoRA resolver "
                        "folders): a load's lora_path must lie inside one, symlinks resolved (default: none, only "
                        "the --lora-modules adapters)")


def add_lora_modules_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                   help="LoRA adapters served as models named NAME, each a PEFT folder (adapter_config.json + "
                        "adapter_model.safetensors); read and checked at start-up")


def add_lora_runtime_updates_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--enable-lora-runtime-updates", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key), which "
                        "load an adapter on every engine or unload it (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


def add_kv_transport_args(g: argparse._ActionsContainer) -> None:
    """--kv-transport and --ucx-net-devices: every engine service's, and `up`'s, which passes them to each."""
    # Defaults from the environment, as --curve-dir's: a compose overlay or a pod's environment switches
    # every service of a deployment at once (compose.ucx.yaml).
    g.add_argument("--kv-transport", default=os.environ.get("EPDSERVE_KV_TRANSPORT", "zmq"), choices=["zmq", "ucx"],
                   help="how KV blocks and image embeddings move between services; every encoder, prefill "
                        "and decode of a deployment must use the same (ucx needs the 'ucx' extra; "
                        "default: $EPDSERVE_KV_TRANSPORT or zmq)")
    g.add_argument("--kv-backend", dest="kv_transport", choices=["zmq", "ucx"], default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name
    g.add_argument("--ucx-net-devices", default=os.environ.get("EPDSERVE_UCX_NET_DEVICES", "all"), metavar="DEVICES",
                   help="with --kv-transport ucx: the network devices UCX may use, comma-separated "
                        "(e.g. eth0 or mlx5_0:1; default: $EPDSERVE_UCX_NET_DEVICES or all, which reaches "
                        "other hosts)")


def add_transport_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport")
    add_kv_transport_args(g)
    g.add_argument("--curve-dir", default=os.environ.get("EPDSERVE_CURVE_DIR"),
                   help="folder with the deployment's CURVE certificate (epdserve keys DIR); "
                        "default $EPDSERVE_CURVE_DIR; unset = no encryption")
    g.add_argument("--secret-file", default=os.environ.get("EPDSERVE_SECRET_FILE"), metavar="FILE",
                   help="file holding the deployment's shared secret (epdserve keys --secret FILE), which every "
                        "handshake between services proves; default $EPDSERVE_SECRET_FILE, else the secret itself "
                        "from $EPDSERVE_SECRET (never on a command line); needed unless the service binds loopback")
    g.add_argument("--rpc-timeout", type=float, default=30.0,
                   help="seconds a control request to a peer may take before it counts as gone")
    g.add_argument("--request-timeout", dest="rpc_timeout", type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name
    g.add_argument("--transfer-timeout", type=float, default=60.0)


def add_service_options(p: argparse.ArgumentParser, role: str) -> None:
    """`epdserve serve <role>`'s options (every role but the KV store and the planner has a `--model`; all the log
    level)."""
    if role not in ("kvstore", "planner"):  # the store holds blocks of any model; the planner reads metrics
        add_model_argument(p)
    add_log_level(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes every interface)")
    p.add_argument("--advertise-host", help="host peers use to reach this process (default: --host)")
    if role == "proxy":
        _add_proxy_options(p)
    elif role == "kvstore":
        _add_kvstore_options(p)
    elif role == "planner":
        _add_planner_service_options(p)
    else:
        add_service_ports(p, "control channel port", "default: <role>-<hostname>-<port>")
        p.add_argument("--data-port", type=int, default=0, help="KV / embedding transfer port (prefill, encoder)")
        p.add_argument("--block-port", type=int, default=0,
                       help="prefill: plain TCP port KV blocks leave on, beside --data-port (ZeroMQ transport "
                            "without CURVE; default: any free port, which decodes learn when they connect)")
        add_served_model_name(p)
        p.add_argument("--lease-seconds", type=float, default=10.0)
        p.add_argument("--encoder-cache-items", type=int, default=256)
        p.add_argument("--max-queue-wait", type=float, default=60.0, metavar="SECONDS",
                       help="refuse a new request (the proxy tries another instance, else answers 503 with "
                            "Retry-After) when the prompts queued ahead of it would take longer than this to "
                            "compute at the engine's measured rate; 0 takes every request (default: %(default)s)")
        add_drain_timeout(p, "on SIGTERM or Ctrl-C, seconds to finish requests in flight (taking no new ones, /ready "
                             "503, DRAINING to the proxies) before the rest are cut and the service exits (default: "
                             "%(default)s)")
        add_engine_args(p)
        if role != "encoder":
            _add_stats_options(p)
            p.add_argument("--kv-store", metavar="HOST:PORT", default=os.environ.get("EPDSERVE_KV_STORE") or None,
                           help="a shared KV store (epdserve serve kvstore): blocks this engine evicts or "
                                "finishes are put there, and a prompt's blocks it lacks are got from there "
                                "(default: $EPDSERVE_KV_STORE; unset: none)")
            p.add_argument("--kv-store-timeout", type=float, default=2.0, metavar="SECONDS",
                           help="how long one call to the KV store may take; past it the store counts as down "
                                "for a few seconds and requests compute their prompts (default: %(default)s)")
    add_transport_args(p)


def add_planner_options(p: argparse._ActionsContainer, scaled: str) -> None:
    """The planner's own options (`up --planner`, `serve planner`); `scaled`: what a role not in the bounds does."""
    p.add_argument("--planner-bounds", metavar="ROLE=LOW:HIGH,...",
                   help=f"e.g. decode=1:2,prefill=1:2,encoder=1:2 (a role not named {scaled})")
    p.add_argument("--ttft-slo", type=float, metavar="SECONDS", help="mean time to first token")
    p.add_argument("--tpot-slo", type=float, metavar="SECONDS", help="mean time per output token")
    p.add_argument("--planner-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between the planner's decisions (default: %(default)s)")
    p.add_argument("--planner-profile", metavar="FILE",
                   help="a profile `epdserve plan --save-profile` wrote: scale to what it predicts the forecast "
                        "load needs, not only on measured SLO breaches")
    p.add_argument("--planner-max-instances", type=int, metavar="N",
                   help="never more than N instances of the roles it scales together (the cores, memory or "
                        "machines they may take: with --threads T each, N x T cores); what does not fit goes to "
                        "the role furthest over its SLO (default: the bounds alone; serve planner: "
                        "$EPDSERVE_PLANNER_MAX_INSTANCES)")


def _add_planner_service_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy-url", required=True, metavar="URL",
                   help="the stack's proxy, whose /metrics and /ready the planner reads (e.g. http://proxy:8000)")
    p.add_argument("--http-port", type=int, default=9000,
                   help="port of /health, /ready and /metrics (epdserve:planner_desired_replicas) (default: "
                        "%(default)s)")
    add_planner_options(p, "is not scaled: no replicas are wanted of it")
    # Also from the environment (compose passes it so: a command cannot leave a flag out while a variable is unset).
    p.set_defaults(planner_max_instances=os.environ.get("EPDSERVE_PLANNER_MAX_INSTANCES") or None)
    add_api_key_options(p, "the proxy's API key, to read its /ready (default: $EPDSERVE_API_KEY)",
                        "a file holding the proxy's API key (overrides --api-key)")
    add_served_model_name(p, "the model_name label of the planner's metric (default: the proxy's first)")


def _add_kvstore_options(p: argparse.ArgumentParser) -> None:
    add_service_ports(p, "control channel port (engines' --kv-store)", "default: kvstore-<hostname>-<port>")
    p.add_argument("--kv-store-size", type=float, default=1.0, metavar="GiB",
                   help="GiB of KV blocks the store keeps in memory, least recently used dropped first "
                        "(default: %(default)s)")
    p.add_argument("--kv-store-disk-size", type=float, default=0.0, metavar="GiB",
                   help="GiB of blocks (per model) kept on disk once memory lets them go, in a memory-mapped "
                        "file (0: no disk; default: %(default)s)")
    p.add_argument("--kv-store-path", metavar="DIR",
                   help="folder of the disk tier's files (removed from the folder once mapped; default: the "
                        "temp folder)")
    add_drain_timeout(p, argparse.SUPPRESS, default=1.0)


def _add_stats_options(p: argparse.ArgumentParser) -> None:
    """The engine's periodic stats line, as vLLM's."""
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log a line of engine stats (throughput, running and waiting requests, KV cache usage, "
                        "prefix cache hit rate) this often, when anything happened since the last one "
                        "(default: %(default)s)")
    p.add_argument("--disable-log-stats", action="store_true", help="no engine stats lines")


def _add_proxy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--inbox-port", type=int, default=0, help="where services push tokens back (0: any)")
    add_served_model_name(p)
    add_api_key_options(p, "required Bearer token (default $EPDSERVE_API_KEY; unset = open). " + _API_KEY_SCOPE,
                        "read the API key from this file instead (a mounted secret; default $EPDSERVE_API_KEY_FILE)")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="put /metrics behind the API key too (its labels and counters describe the API's traffic: "
                        "models, request and token counts, errors); give your scraper the key")
    for name in ("encoder", "prefill", "decode", "unified"):
        p.add_argument(f"--{name}", action="append", metavar="HOST:PORT",
                       help=f"{name} control address(es); repeat or comma-separate; DNS names are re-resolved")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts shorter than this many tokens are prefilled by decode itself")
    add_max_prefill_queue_tokens(p, help="a prompt of at most this many tokens is prefilled by a decode while every "
                                         "prefill instance has at least this many prompt tokens queued and the decode "
                                         "fewer (a burst shared by both roles; 0: never; default: %(default)s)")
    add_routing_policy(p, help="kv: prefill and decode chosen by the prompt blocks each caches (the engines' KV "
                               "events) weighed against load; load: prefill by a hash of the prompt's head, decode by "
                               "free blocks and load (default: %(default)s)")
    p.add_argument("--kv-load-weight", type=float, default=0.25,
                   help="kv routing: what one queued request costs, as a fraction of recomputing the "
                        "whole prompt (default: %(default)s)")
    p.add_argument("--kv-local-prefill-tokens", type=int, default=256,
                   help="kv routing: a decode that caches all but at most this many prompt tokens "
                        "computes them itself, with no prefill and no transfer (default: %(default)s)")
    p.add_argument("--kv-tier-weight", type=float, default=0.8,
                   help="kv routing: what a prompt block in an engine's offload tier (--kv-offloading-size) is "
                        "worth against one in its pool, in [0, 1] (default: %(default)s)")
    p.add_argument("--kv-store", metavar="HOST:PORT", default=os.environ.get("EPDSERVE_KV_STORE") or None,
                   help="kv routing: the shared KV store the engines use (their --kv-store), whose blocks count "
                        "for every instance (default: $EPDSERVE_KV_STORE; unset: none)")
    p.add_argument("--kv-store-weight", type=float, default=0.5,
                   help="kv routing: what a prompt block only the shared KV store holds is worth against one in "
                        "an engine's pool, in [0, 1] (default: %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=600.0,
                   help="seconds a whole prefill may take (long prompts on CPU take a while; "
                        "default: %(default)s)")
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument("--discovery-file", metavar="FILE",
                   help="a JSON file listing the instances of each role ({\"prefill\": [\"HOST:PORT\", ...], "
                        "\"decode\": [...], ...}), read again whenever it changes: a role it names has exactly "
                        "those (scaling without a restart; `epdserve up --planner` writes one)")
    add_migration_limit(p, help="times one request's stream may continue on another decode after its own was lost "
                                "(died, cut off, drained past its grace), from the tokens already sent; 0: never "
                                "(default: %(default)s)")
    p.add_argument("--token-timeout", type=float, default=600.0,
                   help="seconds allowed between two chunks of a stream; also the longest wait for a "
                        "stream's first chunk or a whole non-streamed answer")
    add_drain_timeout(p, help="on SIGTERM or Ctrl-C, seconds requests in flight get to finish (new ones are refused "
                              "with 503, /ready turns 503) before the rest are cut - a stream with an error event and "
                              "[DONE]; a second signal cuts at once (default: %(default)s)")
    p.add_argument("--allowed-image-domains", action="append", metavar="DOMAIN",
                   help="fetch http(s) image URLs only from these domains and their subdomains "
                        "(repeat or comma-separate; default: any public host)")
    p.add_argument("--allow-private-image-urls", action="store_true",
                   help="also fetch image URLs from loopback, private and link-local addresses "
                        "(refused by default: the proxy must not become a way into your network)")
    p.add_argument("--max-request-body-bytes", type=int, default=64 << 20,
                   help="larger request bodies get HTTP 413 (default: %(default)s)")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSER_NAMES),
                   help="how tool calls are read from the text when tool_choice is auto (default: %(default)s)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSER_NAMES),
                   help="return a reasoning model's <think> block as reasoning_content apart from the answer in "
                        "chat responses: deepseek_r1, or qwen3 (which also honours enable_thinking: false in "
                        "chat_template_kwargs) (default: none, the text is the answer)")
    p.add_argument("--max-structured-output-bytes", type=int, default=256 << 10, metavar="BYTES",
                   help="largest output constraint a request may send - a JSON schema, regex, grammar or choice "
                        "list, or the schema of its forced tool calls - as text (a 400 beyond; at most 1 MiB, "
                        "what the services' wire carries; default: %(default)s)")
    p.add_argument("--max-logit-bias", type=int, default=1024, metavar="N",
                   help="most logit_bias entries one request may send (a 400 beyond; default: %(default)s)")
    add_lora_modules_arg(p)
    add_lora_root_arg(p)
    add_lora_runtime_updates_arg(p)
    _add_trace_options(p)
    vllm_flags.add_proxy_flags(p.add_argument_group("vLLM's flags (for vLLM command lines)"))


def _add_trace_options(p: argparse.ArgumentParser) -> None:
    """Per-request traces (the proxy's; `up` passes them on)."""
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export each request's trace (proxy, encoder, prefill, KV transfer, decode stages) with "
                        "OpenTelemetry over OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces (needs "
                        "the 'tracing' extra; default: not exported)")
    p.add_argument("--request-trace", action="store_true",
                   help="return each request's trace in its response, as the extra field epdserve_trace "
                        "(streamed: in the last chunk)")


# Options `up` sets itself on the services it starts (or takes under the same name for them all): the rest of each
# service's options `up` takes too and hands to the services that take them.
UP_SETS_FOR_ENGINES = {"--model", "--log-level", "--host", "--advertise-host", "--port", "--data-port", "--block-port",
                       "--http-port", "--engine-id", "--served-model-name", "--drain-timeout", "--threads",
                       "--speculative-config", "--kv-transport", "--ucx-net-devices", "--kv-store", "--enable-lora",
                       "--lora-modules", "--max-loras", "--max-lora-rank"}
UP_SETS_FOR_PROXY = {"--model", "--log-level", "--host", "--advertise-host", "--port", "--inbox-port", "--discovery-file",
                     "--served-model-name", "--api-key", "--api-key-file", "--encoder", "--prefill", "--decode",
                     "--unified", "--kv-store", "--routing-policy", "--migration-limit", "--max-prefill-queue-tokens",
                     "--drain-timeout", "--otlp-traces-endpoint", "--request-trace", "--lora-modules",
                     "--enable-lora-runtime-updates", "--kv-transport", "--ucx-net-devices"}


class UpForwarding(NamedTuple):
    """What `up` hands on: to the prefill, decode and unified engines, to the encoders, to the proxy."""
    engines: ForwardedOptions
    encoders: ForwardedOptions
    proxy: ForwardedOptions


def add_up_options(up: argparse.ArgumentParser) -> None:
    add_model_argument(up)
    up.add_argument("--port", type=int, default=8000, help="port of the OpenAI API (default: %(default)s)")
    up.add_argument("--host", default="127.0.0.1",
                    help="bind address of the API; 0.0.0.0 exposes it on every interface (default: %(default)s; "
                         "the other services always bind 127.0.0.1)")
    up.add_argument("--internal-ports", type=port_range, metavar="LOW-HIGH",
                    help="the ports the stack's other services listen on (control, data, block and metrics ports "
                         "of every engine, the proxy's inbox): free ports of this range, in order, e.g. 9100-9199 "
                         "(default: any free ports)")
    add_served_model_name(up, help="the model's names in the API (the first in responses, every service's metrics and "
                                   "request traces; each one accepted in requests); up gives them to every service "
                                   "(default: the model folder's name)")
    up.add_argument("--encoders", type=int, metavar="N",
                    help="encoder processes (default: 1 for a multimodal model, else 0)")
    up.add_argument("--prefills", type=int, default=1, metavar="N",
                    help="prefill engine processes (default: %(default)s)")
    up.add_argument("--decodes", type=int, default=1, metavar="N",
                    help="decode engine processes (default: %(default)s)")
    up.add_argument("--unified", action="store_true", help="one unified engine instead of prefills and decodes")
    add_speculative_config(up, help="speculative decoding for the decode (or unified) engines, as their "
                                    "--speculative-config; prefill samples one token and needs none (default: off)")
    add_routing_policy(up, help="how the proxy picks instances: kv (by the prompt blocks each caches, and load) or "
                                "load (default: %(default)s)")
    add_migration_limit(up, help="times the proxy may continue one request's stream on another decode after its own "
                                 "was lost; 0: never (default: %(default)s)")
    add_max_prefill_queue_tokens(up, help="prompts of at most this many tokens are prefilled by a decode while every "
                                          "prefill has as many queued and the decode fewer; 0: never (default: "
                                          "%(default)s)")
    up.add_argument("--kv-store", type=float, nargs="?", const=1.0, metavar="GiB",
                    help="start a shared KV store (epdserve serve kvstore) of this many GiB (1 if none given) that "
                         "every engine puts the blocks it evicts or finishes to and gets missing ones from")
    add_kv_transport_args(up)
    _add_trace_options(up)
    add_lora_engine_args(up)
    add_lora_runtime_updates_arg(up)
    add_api_key_options(up, "Bearer token the API requires (default: $EPDSERVE_API_KEY; unset: open). A key on the "
                            "command line shows in `ps`: prefer --api-key-file or the variable. " + _API_KEY_SCOPE,
                        "read the API key from this file (default: $EPDSERVE_API_KEY_FILE)")
    up.add_argument("--threads", type=int, default=1, metavar="N",
                    help="compute threads per engine process (default: %(default)s)")
    add_drain_timeout(up, help="on Ctrl-C or SIGTERM, seconds the proxy, then each engine, gets to finish requests in "
                               "flight; a second Ctrl-C cuts them, a third kills (default: %(default)s)")
    up.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="seconds to wait for every service to be ready (default: %(default)s)")
    planner = up.add_argument_group("planner (encoders, prefills and decodes added and retired with the load)")
    planner.add_argument("--planner", action="store_true",
                         help="every --planner-interval, scale the roles within --planner-bounds to "
                              "meet --ttft-slo and --tpot-slo, from the proxy's measurements (and a profile, "
                              "--planner-profile); a retired instance gets no new request and stops once idle")
    add_planner_options(planner, "keeps --encoders/--prefills/--decodes")
    add_log_level(up)
    services = {}
    for role in ("decode", "encoder", "proxy"):
        services[role] = argparse.ArgumentParser(add_help=False)
        add_service_options(services[role], role)
    engines = ForwardedOptions(up.add_argument_group("engine options (given to every engine that takes them; "
                                                     "see `epdserve serve decode --help`)"),
                               services["decode"], UP_SETS_FOR_ENGINES)
    encoders = ForwardedOptions(up, services["encoder"], UP_SETS_FOR_ENGINES)  # a subset of the engines'
    proxy = ForwardedOptions(up.add_argument_group("proxy options (see `epdserve serve proxy --help`)"),
                             services["proxy"], UP_SETS_FOR_PROXY)
    up.set_defaults(forwarding=UpForwarding(engines, encoders, proxy), extra=[])
    up.epilog = ("Options after -- go to the prefill, decode and unified engines as given, "
                 "as in `epdserve up -- --max-num-seqs 64`.")


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """The model folder as vLLM takes it, first and without a flag (`epdserve up MODEL`); --model is the same."""
    p.add_argument("model_argument", nargs="?", metavar="MODEL",
                   help="the model folder (or give --model)")
    p.add_argument("--model", metavar="FOLDER",
                   help=f"local HF model folder (default: the {SERVED_BY_DEFAULT} model, built on first use)")
