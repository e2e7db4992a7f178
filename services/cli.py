"""The `epdserve` command.

    epdserve model {default,llava-demo,tiny-llama,tiny-qwen2}   prepare a model folder, print its path
    epdserve serve {encoder,prefill,decode,unified,proxy} ...   run one service
    epdserve up [--model PATH] [--port 8000] [--encoders N --prefills N --decodes N | --unified]
    epdserve keys DIR                                            make the CURVE certificate services share
    epdserve bench serve [--base-url URL] [--dataset-name ...]   load-test an OpenAI-compatible server

Configuration is parsed here, once, into the frozen config objects the services receive.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from epdserve.services.bench.cli import add_bench_parser

ROLES = ("encoder", "prefill", "decode", "unified", "proxy")


# -- epdserve model -----------------------------------------------------------------------------------
def _model_command(args: argparse.Namespace) -> int:
    print(prepare_model(args.which, args.cache_dir, args.out, args.seed))
    return 0


def prepare_model(which: str, cache_dir: str | None = None, out: str | None = None, seed: int = 0) -> Path:
    from epdserve.shared.default_model import default_cache_dir, prepare_default_model

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    text_model = prepare_default_model(cache)
    if which == "default":
        return text_model
    folder = Path(out) if out else cache / "models" / which
    if which == "llava-demo":
        from epdserve.shared.llava_demo import build_llava_demo

        if out is None and (folder / "config.json").is_file():
            return folder  # built before: same seed, same checkpoint
        return build_llava_demo(folder, text_model, seed=seed)
    from epdserve.shared.tiny_models import build_tiny_model

    return build_tiny_model(which.removeprefix("tiny-"), folder, text_model, seed=seed)


def default_serving_model() -> str:
    """What `serve` and `up` run without --model: the multimodal demo (its text answers are SmolLM2's)."""
    return str(prepare_model("llava-demo"))


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
                   help="auto: triton on CUDA, the C++ cpu kernel on CPU (the torch reference if it cannot be built)")
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
    g.add_argument("--request-timeout", type=float, default=30.0)
    g.add_argument("--transfer-timeout", type=float, default=60.0)


def _split_targets(values: list[str] | None) -> tuple[str, ...]:
    return tuple(t for v in values or [] for t in v.split(",") if t)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve", description="Disaggregated LLM serving.")
    parser.add_argument("--log-level", default=os.environ.get("EPDSERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="prepare a model folder; prints its path last")
    model.add_argument("which", choices=["default", "llava-demo", "tiny-llama", "tiny-qwen2"],
                       help="default: SmolLM2-135M-Instruct converted from its GGUF; llava-demo: SmolLM2 behind an "
                            "untrained CLIP vision tower (LLaVA layout); tiny-*: random test models")
    model.add_argument("--cache-dir", help="where prepared models live (default: $EPDSERVE_CACHE_DIR or ~/.cache/epdserve)")
    model.add_argument("--out", help="output folder (tiny and llava-demo models)")
    model.add_argument("--seed", type=int, default=0)
    model.set_defaults(func=_model_command)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        p = roles.add_parser(role)
        p.add_argument("--model", help="HF model folder (default: the multimodal demo model)")
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
            p.add_argument("--poll-interval", type=float, default=1.0)
            p.add_argument("--token-timeout", type=float, default=600.0)
            p.add_argument("--allowed-image-domains", action="append", metavar="DOMAIN",
                           help="fetch http(s) image URLs only from these domains and their subdomains "
                                "(repeat or comma-separate; default: any public host)")
            p.add_argument("--allow-private-image-urls", action="store_true",
                           help="also fetch image URLs from loopback, private and link-local addresses "
                                "(refused by default: the proxy must not become a way into your network)")
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
                           help="on SIGTERM, seconds to finish in-flight requests (taking no new ones) before exiting")
            _add_engine_args(p)
            _add_transport_args(p)
        p.set_defaults(func=_serve_command)

    up = sub.add_parser("up", help="run a whole local stack; Ctrl-C stops it")
    up.add_argument("--model", help="HF model folder (default: the multimodal demo model)")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--encoders", type=int, help="default: 1 for a multimodal model, else 0")
    up.add_argument("--prefills", type=int, default=1)
    up.add_argument("--decodes", type=int, default=1)
    up.add_argument("--unified", action="store_true", help="one unified engine instead of prefill + decode")
    up.add_argument("--api-key", default=os.environ.get("EPDSERVE_API_KEY"))
    up.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    up.add_argument("--startup-timeout", type=float, default=600.0)
    up.add_argument("extra", nargs=argparse.REMAINDER, help="after --: options passed to every engine service")
    up.set_defaults(func=_up_command)

    keys = sub.add_parser("keys", help="create the CURVE certificate every service of a deployment shares")
    keys.add_argument("dir")
    keys.set_defaults(func=_keys_command)

    add_bench_parser(sub)
    return parser


def transport_config(args: argparse.Namespace):
    from epdserve.shared.config import TransportConfig

    return TransportConfig(args.kv_backend, args.curve_dir, args.request_timeout, args.transfer_timeout)


def engine_config(args: argparse.Namespace, model: str):
    from epdserve.shared.llm import build_engine_config

    return build_engine_config(
        model, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_memory * (1 << 30)) if args.kv_cache_memory else None,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend, device=args.device,
        seed=args.seed)


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise SystemExit(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or None


def proxy_config(args: argparse.Namespace, model: str):
    from epdserve.services.proxy.lifecycle import LifecycleConfig
    from epdserve.services.proxy.server import ProxyConfig

    transport = transport_config(args)
    return ProxyConfig(
        model=model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        inbox_port=args.inbox_port, advertise_host=args.advertise_host, api_key=_api_key(args),
        encoders=_split_targets(args.encoder), prefills=_split_targets(args.prefill),
        decodes=_split_targets(args.decode), unified=_split_targets(args.unified), poll_interval=args.poll_interval,
        lifecycle=LifecycleConfig(local_prefill_threshold=args.local_prefill_threshold,
                                  request_timeout=transport.request_timeout, token_timeout=args.token_timeout),
        transport=transport, allowed_image_domains=_split_targets(args.allowed_image_domains),
        allow_private_image_urls=args.allow_private_image_urls)


def service_config(args: argparse.Namespace, threads: int = 1):
    import socket

    from epdserve.shared.config import ServiceConfig

    engine_id = args.engine_id or f"{args.role}-{socket.gethostname()}-{args.port or os.getpid()}"
    return ServiceConfig(args.role, engine_id, args.host, args.port, args.data_port, args.http_port,
                         args.advertise_host, args.lease_seconds, args.encoder_cache_items, transport_config(args),
                         args.drain_timeout, threads, args.served_model_name)


def _serve_command(args: argparse.Namespace) -> int:
    import asyncio

    model = args.model or default_serving_model()
    if args.role == "proxy":
        from epdserve.services.proxy.server import run_proxy

        asyncio.run(run_proxy(proxy_config(args, model)))
        return 0
    import torch

    from epdserve.services.runtime import run_service
    from epdserve.shared.compute_threads import compute_in_one_thread_by_default

    threads = args.threads or torch.get_num_threads()
    compute_in_one_thread_by_default()  # before any op: only the engine's thread gets `threads`
    config = service_config(args, threads)
    engine = engine_config(args, model) if args.role != "encoder" else None
    return asyncio.run(run_service(config, engine, model, args.dtype, args.device))


def _up_command(args: argparse.Namespace) -> int:
    from epdserve.services.launcher import LocalStack

    model = args.model or default_serving_model()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    stack = LocalStack(model, args.host, args.port, args.encoders, args.prefills, args.decodes, args.unified,
                       args.api_key, args.threads, extra)
    return stack.run(args.startup_timeout)


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
