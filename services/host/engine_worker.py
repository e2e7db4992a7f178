"""What prefill, decode and unified services share: an engine, its status, and token streams.

A request's tokens go back to the proxy that sent it as `TokenDelta`s on a push channel to the proxy's
address (`reply_to`); a failure mid-stream is pushed as an `Error` for that request. The engine sees
token ids only: text, stop strings and response formats are the proxy's. The first delta of a request
carries the stages it went through here (`RequestSpans`): embeddings fetched, queue and compute.
"""
from __future__ import annotations

import asyncio
import logging
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable

from epdserve.services.runtime.network import client_curve, peer_auth
from epdserve.services.host.peer_kv_connector import PeerKVConnector, PeerSources
from epdserve.services.host.proxy_channels import ProxyChannels
from epdserve.services.host.request_spans import RequestSpans
from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.services.host.stats_log import StatsLog
from epdserve.services.host.store_kv_connector import StoreKVConnector
from epdserve.shared.engine import AsyncLLM, InputsUnavailableError, LoRARequest, NoLoRASlotError, RequestOutput
from epdserve.shared.config import EngineConfig, ServiceConfig, kv_row_size
from epdserve.shared.processing.multimodal import MultiModalPlaceholder
from epdserve.transport.channel.protocol import (Abort, Ack, DecodeRequest, Error, ErrorCode, FinishReason,
                                                 GenerateRequest, Handshake, Health, HoldCheck, KVEvents,
                                                 KVEventsRequest, KVLayout, LoadLoRA, Message, PrefillRequest, Role,
                                                 Status, TokenDelta, UnloadLoRA, WireLoRA)
from epdserve.services.host.wire import (logprobs_to_wire, mrope_positions_from_wire, prompt_logprobs_to_wire,
                                   sampling_params_from_wire)
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.transports import create_client

if TYPE_CHECKING:
    from epdserve.shared.engine import Request

logger = logging.getLogger(__name__)


def bad_request(request_id: str | None, message: str) -> Error:
    return Error(ErrorCode.BAD_REQUEST, message, request_id)


def no_lora_slot(exc: NoLoRASlotError, request_id: str) -> Error:
    """Every adapter slot is busy with other adapters' requests: a retryable refusal (the proxy tries another
    instance, or answers 503 with Retry-After), not a fault of the request or of this engine."""
    return Error(ErrorCode.OVERLOADED, str(exc), request_id, retryable=True, retry_after=1.0)


def lora_request(lora: WireLoRA) -> LoRARequest:
    # The name identifies the adapter; vLLM's integer id is derived from it, the same on every engine.
    return LoRARequest(lora.name, zlib.crc32(lora.name.encode()) + 1, lora.path)


def kv_layout(engine: EngineConfig) -> KVLayout:
    model = engine.model
    return KVLayout(model.model_id, engine.kv_dtype_name, engine.cache.block_size, model.num_layers,
                    model.num_kv_heads, kv_row_size(model.head_size, engine.kv_dtype_name))


def control_client_kwargs(service: ServiceConfig) -> dict:
    """How this service dials a peer's control channel or a proxy's inbox: as itself, within the RPC timeout."""
    transport = service.transport
    return dict(engine_id=service.engine_id, role=Role(service.role), curve=client_curve(transport),
                auth=peer_auth(transport), timeout=transport.rpc_timeout)


async def start_engine(service: ServiceConfig, engine_config: EngineConfig,
                       on_dead: Callable[[BaseException], None]) -> AsyncLLM:
    """The service's engine, built and run on its own thread (the only one with the service's compute
    threads); `on_dead(cause)` is called on that thread if its loop dies."""
    llm = await asyncio.to_thread(AsyncLLM.from_config, engine_config, detokenize=False, num_threads=service.threads)
    llm.on_dead(on_dead)
    return llm


def kv_transfer_client(service: ServiceConfig, engine_config: EngineConfig, llm: AsyncLLM) -> KVTransferClient:
    """Pulls KV blocks into, and image embeddings for, `llm`'s cache."""
    transport = service.transport
    return create_client(transport.kv_transport, service.engine_id, role=Role(service.role),
                         kv_cache=llm.kv_cache, layout=kv_layout(engine_config),
                         timeout=transport.transfer_timeout, curve=client_curve(transport), auth=peer_auth(transport),
                         **transport.transfer_options())


class EngineWorker:
    """An engine and the streams of its requests. Owns `llm` (with the KV connectors it hands the engine: the
    peers', and the shared store's with --kv-store, closed with it), `kv_client`, and the task that logs the
    engine's stats: `close()` closes them."""

    role: Role = Role.UNIFIED
    data_addr = ""  # where peers pull from; only prefill serves data

    def __init__(self, service: ServiceConfig, engine_config: EngineConfig, llm: AsyncLLM,
                 kv_client: KVTransferClient, rejected_frames: Callable[[], int]) -> None:
        """`rejected_frames()`: frames this service's channels dropped (the metric)."""
        self.service = service
        self.engine_config = engine_config
        self.llm = llm
        self.kv_client = kv_client
        # The engine's stats carry every KV tier's counters, the shared store's too (`KVConnector.stats`).
        self.metrics = ServiceMetrics(service.role, service.engine_id,
                                      service.served_model_name or Path(engine_config.model.path).name,
                                      self.llm.stats, rejected_frames=rejected_frames)
        self.llm.on_step(self.metrics.iteration_tokens.observe)
        self.llm.add_connector(PeerKVConnector(kv_client, self.metrics, asyncio.get_running_loop(),
                                               service.transport.transfer_timeout, engine_config.model.dtype,
                                               control_client_kwargs(service)))
        if service.kv_store:  # after the peers': a peer's KV handle, when it covers as much, goes first
            self.llm.add_connector(StoreKVConnector(service.kv_store, llm.kv_cache, kv_layout(engine_config),
                                                    asyncio.get_running_loop(), control_client_kwargs(service),
                                                    service.kv_store_timeout))
        self.proxies = ProxyChannels(control_client_kwargs(service), on_failure=self._proxy_unreachable)
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop_reason: str | None = None  # set by stop_streams: the streams it stops tell their proxy why
        self._stats_log = None if service.log_stats_interval is None else asyncio.create_task(
            StatsLog(f"{service.role} {service.engine_id}", self.llm.stats).run(service.log_stats_interval))

    def status(self, health: Health) -> Status:
        stats = self.llm.stats()
        lora = self.engine_config.lora
        return Status(self.service.engine_id, self.role, health, stats.num_free_blocks, stats.num_total_blocks,
                      stats.num_running, stats.num_waiting, data_addr=self.data_addr,
                      lora_adapters=tuple(self.llm.lora_adapters()), max_loras=lora.max_loras if lora else 0,
                      max_model_len=self.engine_config.model.max_model_len)

    @property
    def busy(self) -> bool:
        """Requests still in flight here (a draining service waits for them)."""
        return bool(self._tasks)

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, Abort):
            await self.abort(message.request_id)
            return Ack(message.request_id)
        if isinstance(message, HoldCheck):
            if message.request_id in self._tasks:
                return Ack(message.request_id)
            return Error(ErrorCode.NOT_FOUND, "no stream of this request runs here", message.request_id)
        if isinstance(message, GenerateRequest):
            return await self._start_generate(message)
        if isinstance(message, KVEventsRequest):
            return await self._kv_events(message)
        if isinstance(message, (LoadLoRA, UnloadLoRA)):
            return await self._lora_update(message)
        return bad_request(getattr(message, "request_id", None),
                           f"a {self.role.value} service does not take {type(message).__name__}")

    async def _kv_events(self, request: KVEventsRequest) -> KVEvents:
        """What the prefix cache stored and evicted since batch `request.next_seq` (routers follow it)."""
        batch = await self.llm.kv_events(request.next_seq)
        local = next((t for t in batch.tiers if t.tier == "local"), None)
        return KVEvents(self.service.engine_id, self.engine_config.cache.block_size, batch.first_seq, batch.last_seq,
                        b"".join(batch.stored), b"".join(batch.removed), batch.snapshot,
                        b"".join(local.stored) if local else b"", b"".join(local.removed) if local else b"")

    async def _lora_update(self, request: LoadLoRA | UnloadLoRA) -> Message:
        """Read (and check) or forget an adapter; answered with Ack(name), or an Error saying why not."""
        if self.engine_config.lora is None:
            return bad_request(None, f"{self.service.engine_id} serves no LoRA adapters (start it with --enable-lora)")
        if isinstance(request, UnloadLoRA):
            if await self.llm.unload_lora(request.name):
                return Ack(request.name)
            return Error(ErrorCode.NOT_FOUND, f"no LoRA adapter {request.name!r} is loaded here")
        try:
            await self.llm.load_lora(lora_request(WireLoRA(request.name, request.path)))
        except ValueError as exc:
            return bad_request(None, str(exc))
        return Ack(request.name)

    async def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
            # Answered once it has ended: a proxy that sends the request here again finds its id free.
            await asyncio.wait({task})
        else:
            await self.llm.abort(request_id)

    # -- prompt to engine request -------------------------------------------------------------------
    async def make_request(self, message: GenerateRequest | PrefillRequest | DecodeRequest, spans: RequestSpans,
                           **kwargs) -> tuple[Request, PeerSources] | Error:
        """The engine request for `message` (with `make_request`'s keyword arguments), and where its image embeddings
        - and `kv_handle`, a decode's prompt KV - may be had from (with `hold_for_peer`, a prefill's: its KV
        is kept for a decode once finished); or the Error to answer with (a request id in use, bad input).
        The embeddings are fetched only when a step must compute their positions."""
        if message.request_id in self._tasks:
            return bad_request(message.request_id, "request id already in use")
        if message.lora is not None:
            if self.engine_config.lora is None:
                return bad_request(message.request_id, f"LoRA adapter {message.lora.name!r} requested, but this engine serves "
                                                 "no adapters (start it with --enable-lora)")
            kwargs["lora_request"] = lora_request(message.lora)
            if message.lora.name not in self.llm.lora_adapters():  # read it off the event loop first
                try:
                    await self.llm.load_lora(kwargs["lora_request"])
                except ValueError as exc:
                    return bad_request(message.request_id, str(exc))
        sources = PeerSources(spans, kv_handle=kwargs.pop("kv_handle", None),
                              hold_for_peer=kwargs.pop("hold_for_peer", False),
                              encoder_addrs={ph.mm_hash: ph.encoder_addr for ph in message.mm_placeholders})
        try:
            request = await self.llm.make_request(
                {"prompt_token_ids": list(message.prompt_token_ids)}, sampling_params_from_wire(message.sampling_params),
                message.request_id, cache_salt=message.cache_salt, kv_transfer_params=sources,
                mm_placeholders=tuple(MultiModalPlaceholder(p.offset, p.length, p.mm_hash) for p in message.mm_placeholders),
                mrope_positions=mrope_positions_from_wire(message.mrope_positions), **kwargs)
        except ValueError as exc:
            return bad_request(message.request_id, str(exc))
        if request.lora_name is not None and not await self.llm.can_seat_lora(request.lora_name):
            # Every adapter slot is busy with other adapters' requests: another instance may have room.
            return no_lora_slot(NoLoRASlotError(f"no room for LoRA adapter {request.lora_name!r}: all "
                                                f"{self.engine_config.lora.max_loras} adapter slots are in use"),
                                message.request_id)
        return request, sources

    def refuse_if_overloaded(self, request_id: str) -> Error | None:
        """The retryable refusal of a request that would wait past --max-queue-wait behind the prompts queued
        here (the proxy tries another instance, or answers 503 with Retry-After), or None."""
        limit, wait = self.service.max_queue_wait, self.llm.queue_seconds()
        if not limit or wait <= limit:
            return None
        self.metrics.refused_overloaded.inc()
        return Error(ErrorCode.OVERLOADED, f"{wait:.0f}s of prompts are queued here, over --max-queue-wait "
                     f"{limit:g}s", request_id, retryable=True, retry_after=wait)

    # -- streaming back -----------------------------------------------------------------------------
    async def _start_generate(self, message: GenerateRequest) -> Message:
        if refusal := self.refuse_if_overloaded(message.request_id):
            return refusal
        spans = RequestSpans(self.service.engine_id)
        # A stream another instance lost continues here after the tokens it delivered.
        resumed = {"peer_token_ids": [message.output_token_ids]} if message.output_token_ids else {}
        made = await self.make_request(message, spans, **resumed)
        if isinstance(made, Error):
            return made
        request, _ = made
        self.metrics.local_prefills.inc()
        return self.spawn_stream(request, lambda: self._timed(self.llm.generate(request), spans), message.reply_to,
                                 spans)

    @staticmethod
    async def _timed(outputs: AsyncIterator[RequestOutput], spans: RequestSpans) -> AsyncIterator[RequestOutput]:
        """`outputs` of a request this engine prefills; its queue and compute stages recorded by the first."""
        try:
            first = True
            async for out in outputs:
                if first:
                    spans.add_engine_stages(out.metrics)
                    first = False
                yield out
        finally:
            await outputs.aclose()  # aborts the request in the engine if it did not finish

    def spawn_stream(self, request: Request, outputs: Callable[[], AsyncIterator[RequestOutput]],
                     reply_to: str, spans: RequestSpans) -> Message:
        """Stream `outputs()` to the proxy at `reply_to` in a task of its own; the answer to the request. The
        first delta carries `spans`, as recorded by then."""
        request_id = request.group_id  # the id the proxy knows (a request with n > 1 has n sequences)
        try:
            push = self.proxies.acquire(reply_to)
        except ValueError as exc:
            return bad_request(request_id, str(exc))
        if push is None:
            return Error(ErrorCode.OVERLOADED, f"streams to {len(self.proxies)} proxies already", request_id, True)
        task = asyncio.create_task(self._stream(request_id, outputs(), reply_to, spans,
                                                request.sampling_params.logprobs,
                                                request.sampling_params.prompt_logprobs, request.num_peer_tokens))
        self._tasks[request_id] = task

        def done(_) -> None:
            self._tasks.pop(request_id, None)
            self.proxies.release(reply_to)

        task.add_done_callback(done)
        return Ack(request_id)

    async def _stream(self, request_id: str, outputs: AsyncIterator[RequestOutput], reply_to: str,
                      spans: RequestSpans, num_top: int | None, num_prompt_top: int | None = None,
                      num_peer_tokens: int = 0) -> None:
        """`num_peer_tokens`: the tokens each sequence continues from (a peer sampled and delivered them): its
        deltas count on from there, and the first does not say how many prompt tokens were cached - the peer's
        answer said it for the engine that prefilled it."""
        first = True
        offsets: dict[int, int] = {}  # sequence index -> its output tokens sent so far
        try:
            async for out in outputs:
                completion = out.outputs[0]
                reason = FinishReason(completion.finish_reason) if completion.finish_reason else None
                offset = offsets.get(completion.index, num_peer_tokens)
                offsets[completion.index] = offset + len(completion.token_ids)
                self.proxies.send_soon(reply_to, TokenDelta(
                    request_id, tuple(completion.token_ids), logprobs_to_wire(out, num_top), reason,
                    completion.stop_reason, out.num_cached_tokens if first and not num_peer_tokens else None,
                    prompt_logprobs_to_wire(out, num_prompt_top), index=completion.index,
                    trace=spans.take() if first else (), offset=offset))
                first = False
                if out.finished:
                    self.metrics.finished(out)
        except asyncio.CancelledError:
            if self._stop_reason is not None:  # the service is going away: the proxy ends the stream at once
                self.proxies.send_soon(reply_to, Error(ErrorCode.ABORTED, self._stop_reason, request_id))
            raise  # aborted; the engine request was aborted by the iterator's cleanup
        except InputsUnavailableError as exc:  # the proxy encodes the image again and sends the request once more
            logger.warning("request %s failed: %s", request_id, exc)
            self.proxies.send_soon(reply_to, Error(ErrorCode.EMBEDDINGS_UNAVAILABLE, str(exc), request_id))
        except NoLoRASlotError as exc:  # the slots filled up since make_request looked: retryable, as there
            self.proxies.send_soon(reply_to, no_lora_slot(exc, request_id))
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            code = ErrorCode.BAD_REQUEST if isinstance(exc, ValueError) else ErrorCode.INTERNAL
            self.proxies.send_soon(reply_to, Error(code, str(exc), request_id))
        finally:
            await outputs.aclose()

    def _proxy_unreachable(self, address: str, request_ids: list[str], exc: Exception) -> None:
        """Nobody reads these streams any more: stop their requests."""
        logger.warning("cannot stream to %s (%s); aborting %d request(s)", address, exc, len(request_ids))
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

    def stop_streams(self, reason: str) -> None:
        """Stop every stream (the drain grace is over), each telling its proxy `reason`; close() sends that."""
        self._stop_reason = reason
        for task in list(self._tasks.values()):
            task.cancel()

    async def close(self) -> None:
        if self._stats_log is not None:
            self._stats_log.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self.proxies.close()
        await self.llm.close()  # the engine loop, then its KV connectors in order (the peers' uses kv_client)
        await self.kv_client.close()
