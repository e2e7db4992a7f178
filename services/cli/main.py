"""The `epdserve` command.

    epdserve model {llava-demo,smollm2,gemma3-270m,tiny-*,bench-*}  prepare a model folder, print its path
    epdserve serve {encoder,prefill,decode,unified,proxy,kvstore,planner} ...   run one service
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
from typing import Callable

from epdserve.services.cli import vllm_flags
from epdserve.services.cli.run_batch import add_run_batch_parser
from epdserve.services.cli.plan import add_plan_parser
from epdserve.services.bench.cli import add_bench_parser
from epdserve.services.cli.options import (
    ROLES, SERVED_BY_DEFAULT, add_engine_args, add_model_options, add_service_options, add_up_options, log_level,
)
from epdserve.services.proxy.kv_routing import KVRoutingConfig, RoutingPolicy

logger = logging.getLogger(__name__)


# -- epdserve model -----------------------------------------------------------------------------------
def _model_command(args: argparse.Namespace) -> int:
    print(prepare_model(args.which, args.cache_dir, args.out, args.seed))
    return 0


def prepare_model(which: str, cache_dir: str | None = None, out: str | None = None, seed: int = 0) -> Path:
    from epdserve.shared.checkpoints.default_model import default_cache_dir, prepare_default_model

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if which == "gemma3-270m":
        from epdserve.shared.checkpoints.gemma3_270m import prepare_gemma3_270m

        return prepare_gemma3_270m(cache)
    text_model = prepare_default_model(cache)
    if which == "smollm2":
        return text_model
    folder = Path(out) if out else cache / "models" / which
    if which == "llava-demo":
        from epdserve.shared.checkpoints.llava_demo import build_llava_demo
        from epdserve.shared.checkpoints.model_folder import build_once

        if out is not None:
            return build_llava_demo(folder, text_model, seed=seed)
        return build_once(folder, lambda path: build_llava_demo(path, text_model, seed=seed))
    if which == "tiny-qwen2.5-vl":
        from epdserve.shared.checkpoints.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl

        return build_tiny_qwen2_5_vl(folder, text_model, seed=seed)
    from epdserve.shared.checkpoints.tiny_models import BENCH_CONFIGS, build_tiny_model

    if which.startswith("bench-"):
        family = which.removeprefix("bench-")
        return build_tiny_model(family, folder, text_model, seed=seed, **BENCH_CONFIGS[family])
    if which == "tiny-lora":  # on tiny-llama as `epdserve model tiny-llama` builds it
        from epdserve.shared.checkpoints.tiny_lora import build_tiny_lora

        return build_tiny_lora(prepare_model("tiny-llama", cache_dir), folder, seed=seed)
    return build_tiny_model(which.removeprefix("tiny-"), folder, text_model, seed=seed)


def default_serving_model() -> str:
    """What `serve` and `up` run without --model: the multimodal demo (its text answers are SmolLM2's)."""
    return str(prepare_model(SERVED_BY_DEFAULT))


def model_folder(args: argparse.Namespace) -> str:
    """MODEL or --model, checked, or the demo model (built on first use)."""
    from epdserve.shared.checkpoints.model_folder import check_model_folder

    given = getattr(args, "model_argument", None)
    if given is not None and args.model is not None and given != args.model:
        raise SystemExit(f"epdserve: error: two models given: {given} and --model {args.model}; give one")
    args.model = given or args.model
    if args.model is None:
        return default_serving_model()
    try:
        return str(check_model_folder(args.model))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"epdserve: error: --model: {exc}") from None


# -- epdserve serve -----------------------------------------------------------------------------------
def _split_targets(values: list[str] | None) -> tuple[str, ...]:
    return tuple(t for v in values or [] for t in v.split(",") if t)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="epdserve", description="Disaggregated LLM serving.")
    parser.add_argument("--log-level", type=log_level, default=os.environ.get("EPDSERVE_LOG_LEVEL", "info"),
                        metavar="LEVEL",
                        help="debug, info, warning, error or critical (default: $EPDSERVE_LOG_LEVEL or info)")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="prepare a model folder; prints its path last")
    add_model_options(model)
    model.set_defaults(func=_model_command)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        add_service_options(roles.add_parser(role), role)
    serve.set_defaults(func=_serve_command)

    up = sub.add_parser("up", help="run a whole local stack; Ctrl-C stops it",
                        description="Run a whole stack on this machine, each service its own process, "
                                    "and print the API's URL once every service is ready. Ctrl-C stops them all.")
    add_up_options(up)
    up.set_defaults(func=_up_command)

    keys = sub.add_parser("keys", help="create the CURVE certificate (DIR) or the secret (--secret FILE) every "
                                       "service of a deployment shares")
    keys.add_argument("dir", nargs="?")
    keys.add_argument("--secret", metavar="FILE", help="write a new deployment secret to FILE (readable by its owner only)")
    keys.set_defaults(func=_keys_command)

    add_bench_parser(sub)
    add_run_batch_parser(sub, add_engine_args)
    add_plan_parser(sub, add_engine_args)
    return parser


def transport_config(args: argparse.Namespace):
    from epdserve.shared.config import TransportConfig

    try:
        return TransportConfig(args.kv_transport, args.curve_dir, args.rpc_timeout, args.transfer_timeout,
                               args.ucx_net_devices, deployment_secret(args.secret_file, args.host, args.curve_dir))
    except ValueError as exc:  # argparse checks no default: $EPDSERVE_KV_TRANSPORT may hold anything
        raise SystemExit(f"epdserve: error: {exc}") from None


def deployment_secret(path: str | None, host: str, curve_dir: str | None) -> bytes | None:
    """The secret every handshake proves: from --secret-file, else $EPDSERVE_SECRET. Without one a service
    runs only where nothing else can reach it (loopback), or with CURVE (whose keys authenticate)."""
    from epdserve.transport.channel.peer_auth import SECRET_ENV, load_secret
    from epdserve.transport.channel.security import is_loopback

    secret = load_secret(os.environ.get(SECRET_ENV), path)
    if secret is None and not curve_dir:
        if not is_loopback(host):
            raise ValueError(f"a service bound to {host} is reachable from other hosts and needs the deployment's "
                             f"secret: make one with `epdserve keys --secret FILE` and give every service "
                             f"--secret-file FILE (or ${SECRET_ENV})")
    return secret


def engine_config(args: argparse.Namespace, model: str):
    """Raises ValueError for an option out of range, one that contradicts the model or another option, or a vLLM
    flag that cannot apply here."""
    from dataclasses import replace

    from epdserve.shared.engine import build_engine_config

    vllm_flags.check_engine_flags(args, model)
    config = build_engine_config(
        model, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        budget_policy=vllm_flags.budget_policy(args),
        kv_cache_memory_bytes=int(args.kv_cache_memory * (1 << 30)) if args.kv_cache_memory else None,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction or args.gpu_memory_utilization,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend, device=args.device,
        seed=args.seed, grammar_compile_timeout=args.grammar_compile_timeout,
        speculative_config=args.speculative_config,
        kv_offloading_size=args.kv_offloading_size, kv_offloading_path=args.kv_offloading_path,
        kv_offloading_save_finished=args.kv_offloading_save_finished,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        lora_modules=lora_modules(args), lora_roots=lora_roots(args), max_lora_bytes=args.max_lora_bytes,
        profile_moe=args.profile_moe, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization)
    if getattr(args, "role", None) == "prefill" and config.speculative is not None:
        # A prefill's part of a request ends at its first token (handoff.py), so it never has a token to
        # speculate on: a draft model would be loaded, cache and all, for nothing. The config was still
        # checked above, so a bad one stops every role alike.
        logger.info("prefill does not speculate (its part of a request ends at the first token): "
                    "--speculative-config %s is checked, and no draft is loaded", config.speculative.method)
        config = replace(config, speculative=None)
    return config


def lora_roots(args: argparse.Namespace) -> tuple[str, ...]:
    """--lora-root DIR ...: a service reads runtime adapters from these only (none given: none at all)."""
    roots = tuple(args.lora_root or ())
    if roots and hasattr(args, "enable_lora") and not args.enable_lora:
        raise SystemExit("epdserve: error: --lora-root needs --enable-lora")
    missing = [root for root in roots if hasattr(args, "enable_lora") and not os.path.isdir(root)]
    if missing:  # an engine's (the proxy checks paths by their text: it may not see the adapters' files)
        raise SystemExit(f"epdserve: error: --lora-root {missing[0]!r} is not a folder")
    return roots


def lora_modules(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH ..., checked; an engine's need --enable-lora."""
    from epdserve.services.proxy.lora_modules import parse_lora_modules

    try:
        modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None
    if modules and hasattr(args, "enable_lora") and not args.enable_lora:
        raise SystemExit("epdserve: error: --lora-modules needs --enable-lora")
    return modules


def api_key(args: argparse.Namespace) -> str | None:
    """The Bearer token the proxy requires (--api-key-file over --api-key), or None: open."""
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
    from epdserve.services.runtime.network import split_target

    targets = _split_targets(getattr(args, role))
    for target in targets:
        try:
            split_target(target)
        except ValueError as exc:
            raise ValueError(f"--{role} {exc}") from None
    return targets


def proxy_config(args: argparse.Namespace, model: str):
    from epdserve.services.proxy.lifecycle import LifecycleConfig
    from epdserve.services.proxy.output_constraints import ConstraintLimits
    from epdserve.services.proxy.server import ProxyConfig
    from epdserve.shared.block_hash import deployment_key

    for flag, value in (("--migration-limit", args.migration_limit),
                        ("--max-prefill-queue-tokens", args.max_prefill_queue_tokens)):
        if value < 0:
            raise SystemExit(f"epdserve: error: {flag} must be at least 0, got {value}")
    if args.metrics_require_api_key and not api_key(args):
        raise SystemExit("epdserve: error: --metrics-require-api-key needs an API key (--api-key or --api-key-file)")
    transport = transport_config(args)
    vllm_flags.check_shared_flags(args, model)
    return ProxyConfig(
        model=model, served_model_name=tuple(args.served_model_name or ()), host=args.host, port=args.port,
        inbox_port=args.inbox_port, advertise_host=args.advertise_host, api_key=api_key(args),
        metrics_require_api_key=args.metrics_require_api_key,
        encoders=_peer_targets(args, "encoder"), prefills=_peer_targets(args, "prefill"),
        decodes=_peer_targets(args, "decode"), unified=_peer_targets(args, "unified"), poll_interval=args.poll_interval,
        discovery_file=args.discovery_file,
        lifecycle=LifecycleConfig(local_prefill_threshold=args.local_prefill_threshold,
                                  max_prefill_queue_tokens=args.max_prefill_queue_tokens,
                                  rpc_timeout=transport.rpc_timeout, prefill_timeout=args.prefill_timeout,
                                  block_hash_key=deployment_key(transport.secret),
                                  token_timeout=args.token_timeout, migration_limit=args.migration_limit,
                                  kv_routing=KVRoutingConfig(RoutingPolicy(args.routing_policy), args.kv_load_weight,
                                                             args.kv_local_prefill_tokens, args.kv_tier_weight,
                                                             args.kv_store_weight)),
        kv_store=_kv_store_address(args),
        transport=transport, allowed_image_domains=_split_targets(args.allowed_image_domains),
        allow_private_image_urls=args.allow_private_image_urls, access_log=args.log_level == "debug",
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        drain_timeout=args.drain_timeout, max_request_body_bytes=args.max_request_body_bytes,
        otlp_traces_endpoint=args.otlp_traces_endpoint, request_trace=args.request_trace,
        constraint_limits=ConstraintLimits(args.max_structured_output_bytes, args.max_logit_bias),
        lora_modules=lora_modules(args), lora_roots=lora_roots(args),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        chat_template=chat_template(args.chat_template),
        max_images_per_prompt=(args.limit_mm_per_prompt or {}).get("image"))


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (as vLLM: text with Jinja's braces or a newline)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise SystemExit(f"epdserve: error: --chat-template {value}: no such file, and not a template either")


def _kv_store_address(args: argparse.Namespace) -> str | None:
    """--kv-store HOST:PORT as a control address (tcp://...), checked; None when not given."""
    if not getattr(args, "kv_store", None):
        return None
    from epdserve.services.runtime.network import split_target
    from epdserve.transport.channel.security import bracketed

    try:
        host, port = split_target(args.kv_store)
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: --kv-store {exc}") from None
    return f"tcp://{bracketed(host)}:{port}"


def service_config(args: argparse.Namespace, threads: int = 1):
    import socket

    from epdserve.shared.config import ServiceConfig

    engine_id = args.engine_id or f"{args.role}-{socket.gethostname()}-{args.port or os.getpid()}"
    stats_interval = None if args.role in ("encoder", "kvstore") or args.disable_log_stats else args.log_stats_interval
    if stats_interval is not None and stats_interval <= 0:
        raise SystemExit(f"epdserve: error: --log-stats-interval must be positive, got {stats_interval:g} "
                         "(--disable-log-stats turns the lines off)")
    if args.role == "kvstore":
        try:
            return ServiceConfig(args.role, engine_id, args.host, args.port, http_port=args.http_port,
                                 advertise_host=args.advertise_host, transport=transport_config(args),
                                 drain_timeout=args.drain_timeout, log_stats_interval=None,
                                 kv_store_bytes=int(args.kv_store_size * (1 << 30)),
                                 kv_store_disk_bytes=int(args.kv_store_disk_size * (1 << 30)),
                                 kv_store_path=args.kv_store_path)
        except ValueError as exc:
            raise SystemExit(f"epdserve: error: {exc}") from None
    kv_store = _kv_store_address(args)
    try:
        return ServiceConfig(args.role, engine_id, args.host, args.port, args.data_port, args.http_port,
                             args.advertise_host, args.lease_seconds, args.encoder_cache_items, transport_config(args),
                             args.drain_timeout, threads, (args.served_model_name or [None])[0], args.block_port,
                             args.max_queue_wait, stats_interval, kv_store=kv_store,
                             kv_store_timeout=getattr(args, "kv_store_timeout", 2.0))
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None


def _serve_command(args: argparse.Namespace) -> int:
    import asyncio

    if args.role == "kvstore":  # no model: blocks of any layout, by hash
        from epdserve.services.cli.roles import worker_builder
        from epdserve.services.runtime.service import run_service
        from epdserve.shared.compute_threads import compute_in_one_thread_by_default

        # It only copies and checksums blocks: a parallel copy gains nothing on memory bandwidth, and on a
        # host whose engines keep the cores busy each region waits for its slowest thread (a 94 MB get took
        # 0.1-1 s with two threads on 2 busy cores, 0.06 s with one).
        compute_in_one_thread_by_default()
        config = service_config(args)
        _starting(config.engine_id, "no model")
        return asyncio.run(run_service(config, worker_builder(config, None, "")))
    if args.role == "planner":  # no model: it reads the proxy's metrics
        from epdserve.services.planner.service import PlannerService

        config = serve_planner_config(args)
        _starting("planner", args.proxy_url)
        name = args.served_model_name[0] if args.served_model_name else None
        asyncio.run(PlannerService(config, args.proxy_url, api_key(args), name).run(args.host, args.http_port))
        return 0
    model = model_folder(args)
    if args.role == "proxy":
        from epdserve.services.proxy.server import run_proxy

        try:
            config = proxy_config(args, model)
        except ValueError as exc:
            raise SystemExit(f"epdserve: error: {exc}") from None
        _starting("proxy", model)
        asyncio.run(run_proxy(config))
        return 0
    import torch

    from epdserve.services.cli.roles import worker_builder
    from epdserve.services.runtime.service import run_service
    from epdserve.shared.compute_threads import compute_in_one_thread_by_default

    threads = args.threads or torch.get_num_threads()
    compute_in_one_thread_by_default()  # before any op: only the engine's thread gets `threads`
    config = service_config(args, threads)
    try:
        engine = engine_config(args, model) if args.role != "encoder" else None
    except ValueError as exc:  # an engine option out of range, or one that contradicts the model
        raise SystemExit(f"epdserve: error: {exc}") from None
    if engine is not None and config.transport.secret:  # blocks named by hashes only the deployment can make
        from dataclasses import replace

        from epdserve.shared.block_hash import deployment_key

        engine = replace(engine, cache=replace(engine.cache, block_hash_key=deployment_key(config.transport.secret)))
    _starting(config.engine_id, model)
    return asyncio.run(run_service(config, worker_builder(config, engine, model, args.dtype, args.device)))


def _starting(name: str, model: str) -> None:
    """A service's first line, once its command line is found sound: loading takes seconds to minutes."""
    logger.info("%s: starting on %s", name, model)


# Options `up` gives every service that takes them itself, and whom each would miss after -- (which
# reaches the prefill, decode and unified engines only).
UP_OWN_OPTIONS = {"--kv-transport": "the encoders", "--kv-backend": "the encoders", "--ucx-net-devices": "the encoders",
                  "--served-model-name": "the encoders and the proxy", "--lora-modules": "the proxy",
                  "--enable-lora": "the proxy", "--max-loras": "nothing", "--max-lora-rank": "nothing"}


def stack_config(args: argparse.Namespace, model: str):
    from epdserve.services.cli.launcher import StackConfig, is_multimodal

    for flag, value, least in (("--port", args.port, 1), ("--prefills", args.prefills, 0),
                               ("--decodes", args.decodes, 0), ("--encoders", args.encoders, 0),
                               ("--threads", args.threads, 1), ("--drain-timeout", args.drain_timeout, 0),
                               ("--migration-limit", args.migration_limit, 0),
                               ("--max-prefill-queue-tokens", args.max_prefill_queue_tokens, 0)):
        if value is not None and value < least:
            raise SystemExit(f"epdserve: error: {flag} must be at least {least}, got {value}")
    if args.port > 65535:
        raise SystemExit(f"epdserve: error: --port {args.port} is not a port (1 to 65535)")
    if args.kv_store is not None and args.kv_store <= 0:
        raise SystemExit(f"epdserve: error: --kv-store must be a positive size in GiB, got {args.kv_store:g}")
    if not args.unified and args.decodes < 1:
        raise SystemExit("epdserve: error: a stack needs at least one decode (--decodes), or --unified")
    extra = args.extra
    for flag, missed in UP_OWN_OPTIONS.items():
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            raise SystemExit(f"epdserve: error: give {flag} before --: `epdserve up {flag} ...` passes it to "
                             f"every service that takes it; after --, it would miss {missed}")
    if args.internal_ports and args.internal_ports[0] <= args.port <= args.internal_ports[1]:
        raise SystemExit(f"epdserve: error: --port {args.port} is inside --internal-ports "
                         f"{args.internal_ports[0]}-{args.internal_ports[1]}: keep the API's port out of it")
    _check_kv_transport(args)
    try:  # checked once here, not by every service they are given to
        vllm_flags.check_engine_flags(args, model)
        vllm_flags.budget_policy(args)
    except ValueError as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None
    if args.speculative_config is not None:
        from epdserve.shared.config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as exc:
            raise SystemExit(f"epdserve: error: --speculative-config: {exc}") from None
    if args.otlp_traces_endpoint:  # checked here, not by the proxy child after every engine started
        from epdserve.services.proxy.tracing import check_otlp_endpoint

        try:
            check_otlp_endpoint(args.otlp_traces_endpoint)
        except ValueError as exc:
            raise SystemExit(f"epdserve: error: {exc}") from None
    multimodal = is_multimodal(model)
    encoders = args.encoders if args.encoders is not None else int(multimodal)
    planner = up_planner_config(args, encoders, multimodal)
    if planner is not None:  # the stack starts within the bounds

        def bounded(role: str, count: int) -> int:
            low, high = planner.bounds.get(role, (count, count))
            return min(max(count, low), high)

        encoders, args.prefills, args.decodes = (bounded("encoder", encoders), bounded("prefill", args.prefills),
                                                 bounded("decode", args.decodes))
    forwarding = args.forwarding
    if args.chat_template is not None:
        chat_template(args.chat_template)  # a template that is no file and no template is refused now
    return StackConfig(model, args.host, args.port, encoders, args.prefills, args.decodes, args.unified,
                       api_key(args), args.threads, args.log_level, (*forwarding.engines.argv(args), *extra),
                       args.drain_timeout,
                       args.routing_policy, args.kv_transport, args.ucx_net_devices, args.otlp_traces_endpoint,
                       args.request_trace, tuple(args.served_model_name or ()), args.internal_ports,
                       args.migration_limit, args.speculative_config, args.kv_store, lora_args(args),
                       args.enable_lora_runtime_updates, args.max_prefill_queue_tokens,
                       tuple(forwarding.encoders.argv(args)), tuple(forwarding.proxy.argv(args)), planner)


Bounds = dict[str, tuple[int, int]]  # role -> (low, high) instances


def planner_config(args: argparse.Namespace, bounds: Callable[[Bounds], Bounds], needs: str):
    """The planner's options, checked: SLOs, interval, profile, and `bounds(--planner-bounds as given)` (raises
    ValueError) the roles it scales; `needs` begins the errors."""
    from epdserve.services.planner.autoscaler import PlannerConfig, parse_bounds
    from epdserve.services.planner.layout_model import SLO
    from epdserve.services.planner.profile import EngineProfile

    for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo),
                        ("--planner-interval", args.planner_interval)):
        if value is None or not value > 0 or value == float("inf"):
            raise SystemExit(f"epdserve: error: {needs} {flag} above 0" + ("" if value is None else
                                                                          f", got {value:g}"))
    try:
        scaled = bounds(parse_bounds(args.planner_bounds or ""))
        if args.planner_profile is not None:
            EngineProfile.load(args.planner_profile)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"epdserve: error: {exc}") from None
    least = sum(low for low, _ in scaled.values())
    if args.planner_max_instances is not None and args.planner_max_instances < least:
        raise SystemExit(f"epdserve: error: --planner-max-instances {args.planner_max_instances} is fewer than the "
                         f"{least} instances the bounds keep at least ("
                         + ",".join(f"{role}={low}:{high}" for role, (low, high) in scaled.items()) + ")")
    return PlannerConfig(scaled, SLO(args.ttft_slo, args.tpot_slo), args.planner_interval, args.planner_profile,
                         args.planner_max_instances)


def up_planner_config(args: argparse.Namespace, encoders: int, multimodal: bool):
    """`up`'s planner (None without --planner): the roles named in --planner-bounds within theirs, the others held
    at the stack's counts; `encoders`: the stack's, `multimodal`: whether the model takes images."""
    from epdserve.services.planner.autoscaler import bounds_for

    given = [flag for flag, value in (("--planner-bounds", args.planner_bounds), ("--ttft-slo", args.ttft_slo),
                                      ("--tpot-slo", args.tpot_slo), ("--planner-profile", args.planner_profile),
                                      ("--planner-max-instances", args.planner_max_instances))
             if value is not None]
    if not args.planner:
        if given:
            raise SystemExit(f"epdserve: error: {given[0]} needs --planner")
        return None
    if args.unified:
        raise SystemExit("epdserve: error: --planner scales encoders, prefills and decodes: not with --unified")

    def bounds(named: Bounds) -> Bounds:
        if "encoder" in named and not multimodal:
            raise ValueError("--planner-bounds encoder=...: the model takes no images, so it has no encoder to scale")
        return bounds_for(named, encoders, args.prefills, args.decodes)

    config = planner_config(args, bounds, "--planner needs")
    if config.bounds["prefill"][0] < 1:
        raise SystemExit("epdserve: error: --planner needs at least one prefill (--prefills or --planner-bounds)")
    return config


def serve_planner_config(args: argparse.Namespace):
    """`serve planner`'s: it scales the roles named in --planner-bounds, and only those."""
    def bounds(named: Bounds) -> Bounds:
        if not named:
            raise ValueError("epdserve serve planner needs --planner-bounds: the roles it scales")
        return named

    return planner_config(args, bounds, "epdserve serve planner needs")


def lora_args(args: argparse.Namespace) -> tuple[str, ...]:
    """`up`'s LoRA options, as every engine service takes them (the proxy takes --lora-modules of them)."""
    modules = lora_modules(args)
    lora_roots(args)  # checked once here; the engines and the proxy get --lora-root as given
    if args.enable_lora_runtime_updates and not args.enable_lora:
        raise SystemExit("epdserve: error: --enable-lora-runtime-updates needs --enable-lora")
    if not args.enable_lora:
        return ()
    found = ["--lora-modules", *(f"{name}={path}" for name, path in modules)] if modules else []
    return ("--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank), *found)


def _check_kv_transport(args: argparse.Namespace) -> None:
    """Refuse a transport `up` cannot run here, once, rather than in every child it would start."""
    import importlib.util

    from epdserve.shared.config import TransportConfig

    try:
        TransportConfig(args.kv_transport, ucx_net_devices=args.ucx_net_devices)
    except ValueError as exc:  # argparse checks no default: $EPDSERVE_KV_TRANSPORT may hold anything
        raise SystemExit(f"epdserve: error: {exc}") from None
    if args.kv_transport == "ucx" and importlib.util.find_spec("ucxx") is None:
        raise SystemExit("epdserve: error: --kv-transport ucx needs the 'ucx' extra: pip install 'epdserve[ucx]'")


def _up_command(args: argparse.Namespace) -> int:
    from epdserve.services.cli.launcher import LocalStack

    return LocalStack(stack_config(args, model_folder(args))).run(args.startup_timeout)


def _keys_command(args: argparse.Namespace) -> int:
    import zmq.auth

    from epdserve.services.runtime.network import CURVE_CERT
    from epdserve.transport.channel.peer_auth import new_secret

    if not args.dir and not args.secret:
        raise SystemExit("epdserve keys: error: name a folder for the CURVE certificate, or --secret FILE")
    if args.secret:
        try:  # never over an existing secret: services still holding it would lose their peers
            fd = os.open(args.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise SystemExit(f"epdserve keys: error: cannot create {args.secret}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(new_secret() + "\n")
        print(args.secret)
        if not args.dir:
            return 0
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), CURVE_CERT)
    os.chmod(secret, 0o600)
    print(folder)
    return 0


class _Parser(argparse.ArgumentParser):
    """Errors in one line - which option, what is wrong, a near name for an unknown one - not a usage dump."""

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: error: {message} (see `{self.prog} --help`)")


def _active_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's parser that parsed `args`, e.g. `epdserve serve decode`'s."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) is None:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def unknown_argument_error(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """One line on the first unknown argument: the near option names, if any."""
    import difflib

    given = unknown[0]
    if not given.startswith("-"):
        return f"{parser.prog}: error: unexpected argument {given!r} (see `{parser.prog} --help`)"
    flag = given.partition("=")[0]
    near = difflib.get_close_matches(flag, [o for o in parser._option_string_actions if o.startswith("--")], n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else f" (see `{parser.prog} --help`)"
    return f"{parser.prog}: error: unknown option {flag}{hint}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, parsed; what follows `up`'s -- is `extra`, for the engines as given. Exits with one
    line on a mistake."""
    parser = build_parser()
    extra: list[str] = []
    if "up" in argv and "--" in argv[argv.index("up"):]:
        cut = argv.index("--", argv.index("up"))
        argv, extra = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise SystemExit(unknown_argument_error(_active_parser(parser, args), unknown))
    if extra:
        args.extra = extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        # A line per HTTP request (run-batch's and bench's clients) would break their progress bars.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    return args.func(args)
