"""The `epdserve` command.

    epdserve model {llava-demo,smollm2,tiny-llama,tiny-qwen2}   prepare a model folder, print its path
    epdserve serve {encoder,prefill,decode,unified,proxy} ...   run one service
    epdserve up [--model PATH] [--port 8000] [--encoders N --prefills N --decodes N | --unified]
    epdserve keys DIR                                            make the CURVE certificate services share
    epdserve bench serve [--base-url URL] [--dataset-name ...]   load-test an OpenAI-compatible server
    epdserve run-batch -i IN.jsonl -o OUT.jsonl [--model PATH | --base-url URL]   an OpenAI batch file

Configuration is parsed here, once, into the frozen config objects the services receive. A user's
mistake found here (a missing model folder, a malformed peer address) ends the command with one line
on stderr and exit code 1, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from epdserve.services.batch.cli import add_run_batch_parser
from epdserve.services.bench.cli import add_bench_parser
from epdserve.services.proxy.kv_routing import KVRoutingConfig, RoutingPolicy
from epdserve.services.proxy.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES

ROLES = ("encoder", "prefill", "decode", "unified", "proxy")
MODELS = ("llava-demo", "smollm2", "tiny-llama", "tiny-qwen2")
SERVED_BY_DEFAULT = "llava-demo"  # what `up` and `serve` run without --model
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# -- epdserve model -----------------------------------------------------------------------------------
def _model_command(args: argparse.Namespace) -> int:
    print(prepare_model(args.which, args.cache_dir, args.out, args.seed))
    return 0


def prepare_model(which: str, cache_dir: str | None = None, out: str | None = None, seed: int = 0) -> Path:
    from epdserve.shared.checkpoints.default_model import default_cache_dir, prepare_default_model

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    text_model = prepare_default_model(cache)
    if which == "smollm2":
        return text_model
    folder = Path(out) if out else cache / "models" / which
    if which == "llava-demo":
        from epdserve.shared.checkpoints.llava_demo import build_llava_demo

        if out is None and (folder / "config.json").is_file():
            return folder  # built before: same seed, same checkpoint
        return build_llava_demo(folder, text_model, seed=seed)
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return build_tiny_model(which.removeprefix("tiny-"), folder, text_model, seed=seed)


def default_serving_model() -> str:
    """What `serve` and `up` run without --model: the multimodal demo (its text answers are SmolLM2's)."""
    return str(prepare_model(SERVED_BY_DEFAULT))


def model_folder(args: argparse.Namespace) -> str:
    """--model, checked, or the demo model (built on first use)."""
    from epdserve.shared.checkpoints.model_folder import check_model_folder

    if args.model is None:
        return default_serving_model()
    try:
        return str(check_model_folder(args.model))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"epdserve: error: --model: {exc}") from None


# -- epdserve serve -----------------------------------------------------------------------------------
def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=float,
                   help="KV pool size in GiB (default: sized from the memory available, see "
                        "--kv-cache-memory-fraction)")
    g.add_argument("--kv-cache-memory-fraction", type=float,
                   help="share of the memory available at start-up, after the weights, that the KV pool takes when "
                        "no size is given (default 0.05 on CPU, 0.9 on a GPU)")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="auto: triton on CUDA, the C++ cpu kernel on CPU (torch if it cannot be built)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, help="compute threads of the engine (or encoder); the service's other "
                                                "threads use one (default: one per core)")


def _add_transport_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport")
    g.add_argument("--kv-backend", default="zmq", choices=["zmq", "ucx"])
    g.add_argument("--curve-dir", default=os.environ.get("EPDSERVE_CURVE_DIR"),
                   help="folder with the deployment's CURVE certificate (epdserve keys DIR); "
                        "default $EPDSERVE_CURVE_DIR; unset = no authentication")
    g.add_argument("--rpc-timeout", type=float, default=30.0,
                   help="seconds a control request to a peer may take before it counts as gone")
    g.add_argument("--request-timeout", dest="rpc_timeout", type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name
    g.add_argument("--transfer-timeout", type=float, default=60.0)


def _split_targets(values: list[str] | None) -> tuple[str, ...]:
    return tuple(t for v in values or [] for t in v.split(",") if t)


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(LOG_LEVELS)}")
    return value.lower()


def _add_log_level(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: given after the command it overrides `epdserve --log-level`; absent, it leaves that alone.
    p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help="debug, info, warning, error or critical; debug adds a line per HTTP request "
                        "(default: $EPDSERVE_LOG_LEVEL or info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve", description="Disaggregated LLM serving.")
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get("EPDSERVE_LOG_LEVEL", "info"),
                        metavar="LEVEL",
                        help="debug, info, warning, error or critical (default: $EPDSERVE_LOG_LEVEL or info)")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="prepare a model folder; prints its path last")
    model.add_argument("which", choices=MODELS,
                       help=f"{SERVED_BY_DEFAULT}: what `epdserve up` and `make run` serve without --model "
                            "(SmolLM2-135M-Instruct behind an untrained CLIP vision tower, LLaVA layout); "
                            "smollm2: SmolLM2-135M-Instruct alone, converted from its packaged GGUF; "
                            "tiny-*: random test models")
    model.add_argument("--cache-dir", help="where prepared models live (default: $EPDSERVE_CACHE_DIR or ~/.cache/epdserve)")
    model.add_argument("--out", help="output folder (tiny and llava-demo models)")
    model.add_argument("--seed", type=int, default=0)
    model.set_defaults(func=_model_command)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        p = roles.add_parser(role)
        p.add_argument("--model", metavar="FOLDER",
                       help=f"local HF model folder (default: the {SERVED_BY_DEFAULT} model, built on first use)")
        _add_log_level(p)
        p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes every interface)")
        p.add_argument("--advertise-host", help="host peers use to reach this process (default: --host)")
        if role == "proxy":
            p.add_argument("--port", type=int, default=8000)
            p.add_argument("--inbox-port", type=int, default=0, help="where services push tokens back (0: any)")
            p.add_argument("--served-model-name")
            p.add_argument("--api-key", default=os.environ.get("EPDSERVE_API_KEY"),
                           help="required Bearer token (default $EPDSERVE_API_KEY; unset = open)")
            p.add_argument("--api-key-file", default=os.environ.get("EPDSERVE_API_KEY_FILE"),
                           help="read the API key from this file instead (a mounted secret; default "
                                "$EPDSERVE_API_KEY_FILE)")
            for name in ("encoder", "prefill", "decode", "unified"):
                p.add_argument(f"--{name}", action="append", metavar="HOST:PORT",
                               help=f"{name} control address(es); repeat or comma-separate; DNS names are re-resolved")
            p.add_argument("--local-prefill-threshold", type=int, default=0,
                           help="prompts shorter than this many tokens are prefilled by decode itself")
            p.add_argument("--routing-policy", choices=[policy.value for policy in RoutingPolicy], default="kv",
                           help="kv: prefill and decode chosen by the prompt blocks each caches (the engines' KV "
                                "events) weighed against load; load: prefill by a hash of the prompt's head, "
                                "decode by free blocks and load (default: %(default)s)")
            p.add_argument("--kv-load-weight", type=float, default=0.25,
                           help="kv routing: what one queued request costs, as a fraction of recomputing the "
                                "whole prompt (default: %(default)s)")
            p.add_argument("--kv-local-prefill-tokens", type=int, default=256,
                           help="kv routing: a decode that caches all but at most this many prompt tokens "
                                "computes them itself, with no prefill and no transfer (default: %(default)s)")
            p.add_argument("--prefill-timeout", type=float, default=600.0,
                           help="seconds a whole prefill may take (long prompts on CPU take a while; "
                                "default: %(default)s)")
            p.add_argument("--poll-interval", type=float, default=1.0)
            p.add_argument("--token-timeout", type=float, default=600.0,
                           help="seconds allowed between two chunks of a stream; also the longest wait for a "
                                "stream's first chunk or a whole non-streamed answer")
            p.add_argument("--drain-timeout", type=float, default=10.0,
                           help="on SIGTERM or Ctrl-C, seconds requests in flight get to finish (new ones are "
                                "refused with 503, /ready turns 503) before the rest are cut - a stream with an "
                                "error event and [DONE]; a second signal cuts at once (default: %(default)s)")
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
            _add_transport_args(p)
        else:
            p.add_argument("--port", type=int, default=0, help="control channel port")
            p.add_argument("--data-port", type=int, default=0, help="KV / embedding transfer port (prefill, encoder)")
            p.add_argument("--http-port", type=int, default=0, help="/health, /ready, /metrics")
            p.add_argument("--engine-id", help="default: <role>-<hostname>-<port>")
            p.add_argument("--served-model-name", help="model_name label of its metrics (default: the model "
                                                       "folder's name, as the proxy's)")
            p.add_argument("--lease-seconds", type=float, default=10.0)
            p.add_argument("--encoder-cache-items", type=int, default=256)
            p.add_argument("--drain-timeout", type=float, default=10.0,
                           help="on SIGTERM or Ctrl-C, seconds to finish requests in flight (taking no new ones, "
                                "/ready 503, DRAINING to the proxies) before the rest are cut and the service "
                                "exits (default: %(default)s)")
            _add_engine_args(p)
            _add_transport_args(p)
        p.set_defaults(func=_serve_command)

    up = sub.add_parser("up", help="run a whole local stack; Ctrl-C stops it",
                        description="Run a whole stack on this machine, each service its own process, "
                                    "and print the API's URL once every service is ready. Ctrl-C stops them all.")
    up.add_argument("--model", metavar="FOLDER",
                    help=f"local HF model folder (default: the {SERVED_BY_DEFAULT} model, built on first use)")
    up.add_argument("--port", type=int, default=8000, help="port of the OpenAI API (default: %(default)s)")
    up.add_argument("--host", default="127.0.0.1",
                    help="bind address of the API; 0.0.0.0 exposes it on every interface (default: %(default)s; "
                         "the other services always bind 127.0.0.1)")
    up.add_argument("--encoders", type=int, metavar="N",
                    help="encoder processes (default: 1 for a multimodal model, else 0)")
    up.add_argument("--prefills", type=int, default=1, metavar="N",
                    help="prefill engine processes (default: %(default)s)")
    up.add_argument("--decodes", type=int, default=1, metavar="N",
                    help="decode engine processes (default: %(default)s)")
    up.add_argument("--unified", action="store_true", help="one unified engine instead of prefills and decodes")
    up.add_argument("--routing-policy", choices=[policy.value for policy in RoutingPolicy], default="kv",
                    help="how the proxy picks instances: kv (by the prompt blocks each caches, and load) or load "
                         "(default: %(default)s)")
    up.add_argument("--api-key", default=os.environ.get("EPDSERVE_API_KEY"), metavar="KEY",
                    help="Bearer token the API requires (default: $EPDSERVE_API_KEY; unset: open). A key on the "
                         "command line shows in `ps`: prefer --api-key-file or the variable")
    up.add_argument("--api-key-file", default=os.environ.get("EPDSERVE_API_KEY_FILE"), metavar="FILE",
                    help="read the API key from this file (default: $EPDSERVE_API_KEY_FILE)")
    up.add_argument("--threads", type=int, default=1, metavar="N",
                    help="compute threads per engine process (default: %(default)s)")
    up.add_argument("--drain-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="on Ctrl-C or SIGTERM, seconds the proxy, then each engine, gets to finish requests in "
                         "flight; a second Ctrl-C cuts them, a third kills (default: %(default)s)")
    up.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="seconds to wait for every service to be ready (default: %(default)s)")
    _add_log_level(up)
    up.add_argument("extra", nargs=argparse.REMAINDER, metavar="-- ENGINE_OPTION",
                    help="after --: options passed to every engine service (see `epdserve serve decode --help`)")
    up.set_defaults(func=_up_command)

    keys = sub.add_parser("keys", help="create the CURVE certificate every service of a deployment shares")
    keys.add_argument("dir")
    keys.set_defaults(func=_keys_command)

    add_bench_parser(sub)
    add_run_batch_parser(sub, _add_engine_args)
    return parser


def transport_config(args: argparse.Namespace):
    from epdserve.shared.config import TransportConfig

    return TransportConfig(args.kv_backend, args.curve_dir, args.rpc_timeout, args.transfer_timeout)


def engine_config(args: argparse.Namespace, model: str):
    from epdserve.shared.engine.llm import build_engine_config

    return build_engine_config(
        model, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_memory * (1 << 30)) if args.kv_cache_memory else None,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend, device=args.device,
        seed=args.seed)


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"epdserve: error: --api-key-file {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise SystemExit(f"epdserve: error: --api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or None


def _peer_targets(args: argparse.Namespace, role: str) -> tuple[str, ...]:
    """--<role> addresses, each checked: a typo is refused here rather than retried forever."""
    from epdserve.services.network import split_target

    targets = _split_targets(getattr(args, role))
    for target in targets:
        try:
            split_target(target)
        except ValueError as exc:
            raise ValueError(f"--{role} {exc}") from None
    return targets


def proxy_config(args: argparse.Namespace, model: str):
    from epdserve.services.proxy.lifecycle import LifecycleConfig
    from epdserve.services.proxy.server import ProxyConfig

    transport = transport_config(args)
    return ProxyConfig(
        model=model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        inbox_port=args.inbox_port, advertise_host=args.advertise_host, api_key=_api_key(args),
        encoders=_peer_targets(args, "encoder"), prefills=_peer_targets(args, "prefill"),
        decodes=_peer_targets(args, "decode"), unified=_peer_targets(args, "unified"), poll_interval=args.poll_interval,
        lifecycle=LifecycleConfig(local_prefill_threshold=args.local_prefill_threshold,
                                  rpc_timeout=transport.rpc_timeout, prefill_timeout=args.prefill_timeout,
                                  token_timeout=args.token_timeout,
                                  kv_routing=KVRoutingConfig(RoutingPolicy(args.routing_policy), args.kv_load_weight,
                                                             args.kv_local_prefill_tokens)),
        transport=transport, allowed_image_domains=_split_targets(args.allowed_image_domains),
        allow_private_image_urls=args.allow_private_image_urls, access_log=args.log_level == "debug",
        tool_call_parser=args.tool_call_parser,
        drain_timeout=args.drain_timeout, max_request_body_bytes=args.max_request_body_bytes)


def service_config(args: argparse.Namespace, threads: int = 1):
    import socket

    from epdserve.shared.config import ServiceConfig

    engine_id = args.engine_id or f"{args.role}-{socket.gethostname()}-{args.port or os.getpid()}"
    return ServiceConfig(args.role, engine_id, args.host, args.port, args.data_port, args.http_port,
                         args.advertise_host, args.lease_seconds, args.encoder_cache_items, transport_config(args),
                         args.drain_timeout, threads, args.served_model_name)


def _serve_command(args: argparse.Namespace) -> int:
    import asyncio

    model = model_folder(args)
    if args.role == "proxy":
        from epdserve.services.proxy.server import run_proxy

        try:
            config = proxy_config(args, model)
        except ValueError as exc:
            raise SystemExit(f"epdserve: error: {exc}") from None
        asyncio.run(run_proxy(config))
        return 0
    import torch

    from epdserve.services.runtime import run_service
    from epdserve.shared.engine.compute_threads import compute_in_one_thread_by_default

    threads = args.threads or torch.get_num_threads()
    compute_in_one_thread_by_default()  # before any op: only the engine's thread gets `threads`
    config = service_config(args, threads)
    try:
        engine = engine_config(args, model) if args.role != "encoder" else None
    except ValueError as exc:  # an engine option out of range, or one that contradicts the model
        raise SystemExit(f"epdserve: error: {exc}") from None
    return asyncio.run(run_service(config, engine, model, args.dtype, args.device))


def stack_config(args: argparse.Namespace, model: str):
    from epdserve.services.launcher import StackConfig, is_multimodal

    for flag, value, least in (("--port", args.port, 1), ("--prefills", args.prefills, 0),
                               ("--decodes", args.decodes, 0), ("--encoders", args.encoders, 0),
                               ("--threads", args.threads, 1), ("--drain-timeout", args.drain_timeout, 0)):
        if value is not None and value < least:
            raise SystemExit(f"epdserve: error: {flag} must be at least {least}, got {value}")
    if args.port > 65535:
        raise SystemExit(f"epdserve: error: --port {args.port} is not a port (1 to 65535)")
    if not args.unified and args.decodes < 1:
        raise SystemExit("epdserve: error: a stack needs at least one decode (--decodes), or --unified")
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    encoders = args.encoders if args.encoders is not None else int(is_multimodal(model))
    return StackConfig(model, args.host, args.port, encoders, args.prefills, args.decodes, args.unified,
                       _api_key(args), args.threads, args.log_level, tuple(extra), args.drain_timeout,
                       args.routing_policy)


def _up_command(args: argparse.Namespace) -> int:
    from epdserve.services.launcher import LocalStack

    return LocalStack(stack_config(args, model_folder(args))).run(args.startup_timeout)


def _keys_command(args: argparse.Namespace) -> int:
    import zmq.auth

    from epdserve.services.network import CURVE_CERT

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), CURVE_CERT)
    os.chmod(secret, 0o600)
    print(folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
