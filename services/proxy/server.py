"""Builds the proxy from its config and serves it: router + service backend + OpenAI layer on uvicorn.

SIGTERM or SIGINT drains the proxy (drain.py): /ready turns 503, new requests are refused with a 503,
requests in flight get `drain_timeout` seconds to finish; a second signal cuts them at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from epdserve.services.proxy.app import MAX_BODY_BYTES, build_app
from epdserve.services.proxy.drain import Drain, DrainGate
from epdserve.services.proxy.images import ImageFetcher, MultimodalChatEncoder
from epdserve.services.proxy.kv_routing import RoutingPolicy
from epdserve.services.proxy.lifecycle import LifecycleConfig, ServiceBackend
from epdserve.services.proxy.lora_modules import LoRAModules
from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.output_constraints import ConstraintLimits
from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.services.proxy.discovery import Discovery
from epdserve.services.proxy.router import RolePool, Router
from epdserve.services.proxy.serving import OpenAIServing
from epdserve.services.proxy.startup import Startup
from epdserve.services.proxy.tracing import OTelExport, Tracer, check_otlp_endpoint
from epdserve.services.runtime.management import SignalFreeServer
from epdserve.services.runtime.network import client_curve, peer_auth, say_if_unauthenticated, server_curve
from epdserve.shared.config import ModelConfig, TransportConfig
from epdserve.transport.channel.protocol import MAY_SEND, Role
from epdserve.shared.processing.tokenizer import load_tokenizer
from epdserve.transport.channel.reply_server import PullChannel
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.channel.security import WILDCARD_HOSTS, bracketed

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    model: str  # the model folder: tokenizer, chat template, image processor, context length
    # The model's names in the API: the first in responses, /v1/models and metrics; each one accepted in
    # requests (none: the folder's name).
    served_model_name: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    # Where the proxy's inbox binds (services push tokens to it) and the host they reach it by.
    inbox_port: int = 0
    advertise_host: str | None = None
    api_key: str | None = None
    metrics_require_api_key: bool = False  # /metrics behind the API key too (open by default, as vLLM's)
    encoders: tuple[str, ...] = ()  # host:port of control channels; host names are re-resolved
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    unified: tuple[str, ...] = ()
    poll_interval: float = 1.0
    resolve_interval: float = 5.0
    # A file listing the instances of each role (discovery.py), which a planner rewrites as it scales them.
    discovery_file: str | None = None
    # The shared KV store's control address (tcp://host:port; None: none): KV-aware routing follows what
    # it holds too (its events), counting those blocks at the routing config's store_weight.
    kv_store: str | None = None
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    max_image_bytes: int = 20 << 20
    allowed_image_domains: tuple[str, ...] = ()  # empty: any public host
    allow_private_image_urls: bool = False  # image URLs on loopback/private/link-local hosts
    max_request_body_bytes: int = MAX_BODY_BYTES  # larger bodies get 413
    # uvicorn's line per HTTP request and its startup chatter (`--log-level debug`); off, a stack starting
    # up would print a line per readiness probe.
    access_log: bool = False
    # On SIGTERM: seconds requests in flight get to finish before they are cut (an error event and
    # `data: [DONE]` for a stream). A pod's terminationGracePeriodSeconds must exceed it.
    drain_timeout: float = 10.0
    tool_call_parser: str = "hermes"  # see tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # see reasoning_parsers.REASONING_PARSERS; None: no reasoning parsed
    # Each request's trace (tracing.py): exported over OTLP/HTTP to this URL (None: not exported), and
    # returned in its response (`epdserve_trace`) when `request_trace`.
    otlp_traces_endpoint: str | None = None
    request_trace: bool = False
    constraint_limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    # LoRA adapters offered as models: (name, PEFT folder) from the start, and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time.
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_roots: tuple[str, ...] = ()  # the folders runtime loads may name (--lora-root)
    enable_lora_runtime_updates: bool = False
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's (the text, not a path)
    max_images_per_prompt: int | None = None  # more in one request is a 400 (None: no limit)

    def __post_init__(self):
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be at least 0, got {self.drain_timeout:g}")
        if not self.unified and not (self.prefills or self.decodes):
            raise ValueError("give --unified instances, or --prefill and --decode instances")
        if self.unified and (self.prefills or self.decodes):
            raise ValueError("give either --unified instances or --prefill/--decode instances, not both")
        if not self.unified and not self.decodes:
            raise ValueError("a disaggregated deployment needs at least one --decode instance")
        if self.otlp_traces_endpoint:
            check_otlp_endpoint(self.otlp_traces_endpoint)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else Path(self.model).name


def is_multimodal(model_path: str) -> bool:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return "vision_config" in config


async def build_proxy(config: ProxyConfig):
    """(app, router, backend, drain, tracer, startup): the app listens once `router.start()` and
    `backend.start()` ran, and serves the API once `startup` finds every role ready (`startup.watch()` logs
    it); `drain.run()` shuts it down gracefully; `tracer.shutdown()` sends the last traces."""
    model_config = ModelConfig.from_pretrained(config.model)
    tokenizer = load_tokenizer(config.model)
    if tokenizer is None:
        raise FileNotFoundError(f"{config.model} has no tokenizer: the proxy needs one")
    if config.chat_template is not None:
        tokenizer.hf.chat_template = config.chat_template
    engine_id = f"proxy-{config.port}"

    def make_client(address: str, role: Role) -> RequestClient:
        return RequestClient(address, engine_id=engine_id, role=Role.PROXY, timeout=config.transport.rpc_timeout,
                             curve=client_curve(config.transport), auth=peer_auth(config.transport))

    # KV-aware routing: what every engine's prefix cache holds, from its KV events (encoders have none).
    index = PrefixIndex() if config.lifecycle.kv_routing.policy is RoutingPolicy.KV else None
    pools = {role: RolePool(role, targets, make_client, index=None if role == Role.ENCODER else index)
             for role, targets in ((Role.ENCODER, config.encoders), (Role.PREFILL, config.prefills),
                                   (Role.DECODE, config.decodes), (Role.UNIFIED, config.unified))}
    store = make_client(config.kv_store, Role.KVSTORE) if config.kv_store and index is not None else None
    discovery = Discovery(config.discovery_file) if config.discovery_file else None
    router = Router(pools, config.poll_interval, config.resolve_interval, index, store, discovery)
    wildcard = config.host in WILDCARD_HOSTS
    inbox = PullChannel(engine_id, host=config.host, port=config.inbox_port, allow_wildcard=wildcard,
                        curve=server_curve(config.transport), auth=peer_auth(config.transport), senders=MAY_SEND)
    metrics = ProxyMetrics(config.model_name, rejected_frames=lambda: inbox.num_rejected,
                           max_model_len=model_config.max_model_len)
    if index is not None:
        metrics.watch_prefix_index(index)
    if discovery is not None:
        metrics.watch_planner(lambda: discovery.desired)
    metrics.watch_prompt_queues(lambda: [i for role in (Role.PREFILL, Role.DECODE, Role.UNIFIED)
                                         for i in tuple(pools[role].instances.values())])
    backend = ServiceBackend(router, inbox, config.lifecycle, config.host, config.advertise_host, metrics.routed,
                             engine_id, metrics.migrated, metrics.reencoded)
    export = OTelExport.otlp(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    tracer = Tracer(engine_id, metrics.observe_stage, export, config.model_name)
    chat_encoder = None
    if is_multimodal(config.model):
        chat_encoder = MultimodalChatEncoder(tokenizer, config.model, ImageFetcher(
            config.max_image_bytes, allowed_domains=config.allowed_image_domains,
            allow_private=config.allow_private_image_urls))
    loras = LoRAModules(config.model_name, config.lora_modules, config.enable_lora_runtime_updates,
                        config.lora_roots)
    loras.fan_out = backend.broadcast
    serving = OpenAIServing(config.model_name, tokenizer, backend, model_config.max_model_len,
                            model_config.vocab_size, metrics, chat_encoder,
                            response_timeout=config.lifecycle.token_timeout, tool_call_parser=config.tool_call_parser,
                            tracer=tracer, request_trace=config.request_trace,
                            constraint_limits=config.constraint_limits, loras=loras,
                            model_aliases=config.served_model_name[1:],
                            max_images_per_prompt=config.max_images_per_prompt,
                            max_model_len_in_force=router.max_model_len, reasoning_parser=config.reasoning_parser)

    drain = Drain(config.drain_timeout)
    drain.on_cut(backend.cut)

    startup = Startup(router.readiness, config.model_name, f"http://{bracketed(config.host)}:{config.port}")

    async def readiness():
        startup.waiting_for()  # the first look that finds the proxy ready logs its ready line: before a 200
        ready, details = router.readiness()
        return ready and not drain.draining, details | {"draining": drain.draining}

    app = DrainGate(build_app(serving, metrics, config.api_key, readiness, config.max_request_body_bytes,
                              startup.waiting_for, config.metrics_require_api_key), drain, metrics.responded)
    return app, router, backend, drain, tracer, startup


async def run_proxy(config: ProxyConfig) -> None:
    say_if_unauthenticated(config.transport, config.host)
    app, router, backend, drain, tracer, startup = await build_proxy(config)
    await backend.start()
    await router.start()
    # Requests are over when the drain ends; the shutdown's own timeout only bounds idle connections.
    server = SignalFreeServer(uvicorn.Config(app, host=config.host, port=config.port,
                                             log_level="info" if config.access_log else "warning",
                                             access_log=config.access_log, timeout_graceful_shutdown=2))
    draining: list[asyncio.Task] = []

    async def drain_then_exit() -> None:
        await drain.run()
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        if not draining:
            logger.info("%s: draining (up to %.0fs; a second signal cuts at once)", sig.name, config.drain_timeout)
            draining.append(asyncio.create_task(drain_then_exit()))
        else:
            drain.cut()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    # No URL yet: the first line with one is the ready line (startup.py), once the API serves.
    logger.info("proxy for %s starting: the API answers 503 until every role has a ready instance",
                config.model_name)
    watching = asyncio.create_task(startup.watch())
    try:
        await server.serve()  # returns once the drain is over
    finally:
        watching.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await router.close()
        await backend.close()
        await asyncio.to_thread(tracer.shutdown)  # the exporter's last batch, sent from its own thread
