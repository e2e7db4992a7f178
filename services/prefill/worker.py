"""The prefill service: computes prompts, samples the first token, and holds the KV for decode.

A PrefillRequest runs to its first token with the request's own sampling parameters. If that token ends
the request (a stop token, or max_tokens == 1) the blocks are freed at once; otherwise they stay
allocated under a lease and are exposed, for that request id only, on this service's KV transfer server,
under a generation of their own that the KVHandle carries (a fetch with another one is refused). They are
withdrawn when decode sends Release, when the proxy aborts the request, or when the lease runs out
(seconds, renewable, counted in a metric): a dead decode never pins them for long. Withdrawn blocks are
freed once no send reads them any more (a send that outlasts --transfer-timeout is cut, and still waited
for): a fetch in flight never reads blocks that were freed, let alone reused.

A request with n > 1 is prefilled once and samples n first tokens, one per sequence (each with its own
seed stream); the sequences share one set of prompt blocks, which is what decode pulls.

PrefillDone carries the request's stages here: `embeddings.fetch` (per image), `prefill.queue` (arrival
until first scheduled) and `prefill.compute` (first scheduled until the first token).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from epdserve.services.host.engine_worker import (EngineWorker, bad_request, kv_layout, kv_transfer_client, no_lora_slot,
                                             start_engine)
from epdserve.services.runtime.network import advertised, peer_auth, server_curve
from epdserve.services.host.request_spans import RequestSpans
from epdserve.shared.engine import (PREFILL_OUTPUT_TOKENS, AsyncLLM, InputsUnavailableError, NoLoRASlotError,
                                    RequestOutput)
from epdserve.shared.config import EngineConfig, ServiceConfig
from epdserve.transport.channel.protocol import (Abort, Ack, Error, ErrorCode, FinishReason, FirstToken, Handshake,
                                                 KVHandle, LeaseRenewed, Message, PrefillDone, PrefillRequest, Release,
                                                 RenewLease, Role, TokenLogprobs)
from epdserve.services.host.wire import logprobs_to_wire, prompt_logprobs_to_wire
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.transports import create_server
from epdserve.transport.channel.security import WILDCARD_HOSTS

logger = logging.getLogger(__name__)


async def build_prefill_worker(service: ServiceConfig, engine_config: EngineConfig, control_addr: str,
                               control_rejected: Callable[[], int],
                               on_dead: Callable[[BaseException], None]) -> PrefillWorker:
    """A prefill worker whose KV server is serving; `control_addr`: where decode sends Release."""
    llm = await start_engine(service, engine_config, on_dead)
    transport = service.transport
    kv_server = create_server(transport.kv_transport, service.engine_id, kv_cache=llm.kv_cache,
                              layout=kv_layout(engine_config), host=service.host, port=service.data_port,
                              allow_wildcard=service.host in WILDCARD_HOSTS, curve=server_curve(transport),
                              auth=peer_auth(transport), **transport.server_options(service.block_port))
    data_addr = advertised(await kv_server.start(), service.host, service.advertise_host)
    return PrefillWorker(service, engine_config, llm, kv_transfer_client(service, engine_config, llm),
                         lambda: control_rejected() + kv_server.num_rejected,
                         kv_server=kv_server, data_addr=data_addr, control_addr=control_addr)


class PrefillWorker(EngineWorker):
    """Also owns `kv_server`, which serves its held KV at `data_addr`."""

    role = Role.PREFILL

    def __init__(self, service: ServiceConfig, engine_config: EngineConfig, llm: AsyncLLM,
                 kv_client: KVTransferClient, rejected_frames: Callable[[], int], *, kv_server: KVTransferServer,
                 data_addr: str, control_addr: str) -> None:
        super().__init__(service, engine_config, llm, kv_client, rejected_frames)
        self.kv_server = kv_server
        self.data_addr = data_addr
        self.control_addr = control_addr  # where decode sends Release
        self.leases: dict[str, float] = {}  # request id -> monotonic deadline of its held KV
        self._lease_task: asyncio.Task | None = None  # expires leases; started with the first one
        # request id -> the task freeing its withdrawn blocks once their last sends are done
        self._freeing: dict[str, asyncio.Task] = {}

    @property
    def busy(self) -> bool:
        return super().busy or bool(self.leases)  # held KV: a decode may still pull it

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, PrefillRequest):
            return await self._prefill(message)
        if isinstance(message, Release):
            await self._release(message.request_id)
            return Ack(message.request_id)
        if isinstance(message, RenewLease):
            if message.request_id not in self.leases:
                return Error(ErrorCode.NOT_FOUND, "no KV held for this request", message.request_id)
            self.leases[message.request_id] = time.monotonic() + self.service.lease_seconds
            return LeaseRenewed(message.request_id, time.time() + self.service.lease_seconds)
        if isinstance(message, Abort) and message.request_id in self.leases:
            await self._release(message.request_id)
            # Answered once its blocks are free: a proxy that sends the request here again finds its id free.
            await asyncio.wait({self._freeing[message.request_id]})
            return Ack(message.request_id)
        return await super().handle(message, peer)

    async def _prefill(self, message: PrefillRequest) -> Message:
        rid = message.request_id
        if rid in self.leases or rid in self._freeing:  # its blocks are released by request id
            return bad_request(rid, "request id already in use")
        if refusal := self.refuse_if_overloaded(rid):
            return refusal
        spans = RequestSpans(self.service.engine_id)
        # This engine's part ends at each sequence's first token (n > 1: one prefill, a first token each).
        made = await self.make_request(message, spans, hold_for_peer=True, max_output_tokens=PREFILL_OUTPUT_TOKENS)
        if isinstance(made, Error):
            return made
        request, _ = made
        room = self.engine_config.model.max_model_len - len(message.prompt_token_ids)
        wants_more = min(message.sampling_params.max_tokens or room, room) > PREFILL_OUTPUT_TOKENS
        task = asyncio.current_task()
        self._tasks[rid] = task
        try:
            out, prompt_logprobs = None, ()
            firsts: dict[int, RequestOutput] = {}  # sequence index -> the output with its first token
            async for out in self.llm.generate(request):
                if out.outputs[0].token_ids:
                    firsts[out.outputs[0].index] = out
                prompt_logprobs = prompt_logprobs_to_wire(out, request.sampling_params.prompt_logprobs) or \
                    prompt_logprobs
        except asyncio.CancelledError:  # aborted by the proxy while prefilling
            self.llm.release_kv(rid)
            return Error(ErrorCode.ABORTED, "aborted", rid)
        except InputsUnavailableError as exc:  # the proxy encodes the image again and sends the request once more
            return Error(ErrorCode.EMBEDDINGS_UNAVAILABLE, str(exc), rid)
        except NoLoRASlotError as exc:  # the slots filled up since make_request looked: another instance may have one
            return no_lora_slot(exc, rid)
        finally:
            self._tasks.pop(rid, None)
        out = firsts[0]
        completion = out.outputs[0]
        first = completion.token_ids[0]
        num_top = request.sampling_params.logprobs
        first_logprobs = self._first_logprobs(out, num_top)
        ends_here = all(f.outputs[0].finish_reason == "stop" for f in firsts.values()) or not wants_more
        self.metrics.local_prefills.inc()
        self.metrics.finished(out, ends_here)  # this engine's part ends here, whether or not decode goes on
        spans.add_engine_stages(out.metrics)
        if ends_here:
            self.llm.release_kv(rid)
            others = tuple(FirstToken(f.outputs[0].token_ids[0], self._first_logprobs(f, num_top),
                                      FinishReason(f.outputs[0].finish_reason)) for _, f in sorted(firsts.items())[1:])
            return PrefillDone(rid, first, None, out.num_cached_tokens, FinishReason(completion.finish_reason),
                               first_logprobs, other_first_tokens=others, prompt_logprobs=prompt_logprobs,
                               trace=spans.take())
        # The sequences share the prompt's blocks (those that stopped hold them too, until the release).
        others = tuple(FirstToken(f.outputs[0].token_ids[0], self._first_logprobs(f, num_top))
                       for _, f in sorted(firsts.items())[1:])
        # From the output itself: asking the engine thread would wait out the step it is running.
        block_ids = out.kv_block_ids
        generation = self.kv_server.expose(rid, block_ids)
        self.leases[rid] = time.monotonic() + self.service.lease_seconds
        if self._lease_task is None:
            self._lease_task = asyncio.create_task(self._expire_leases())
        handle = KVHandle(self.service.engine_id, self.data_addr, tuple(block_ids), generation,
                          len(message.prompt_token_ids), time.time() + self.service.lease_seconds, self.control_addr)
        return PrefillDone(rid, first, handle, out.num_cached_tokens, None, first_logprobs,
                           other_first_tokens=others, prompt_logprobs=prompt_logprobs, trace=spans.take())

    @staticmethod
    def _first_logprobs(out: RequestOutput, num_top: int | None) -> TokenLogprobs | None:
        logprobs = logprobs_to_wire(out, num_top)
        return logprobs[0] if logprobs else None

    async def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
            # Answered once it has ended: a proxy that sends the request here again finds its id free.
            await asyncio.wait({task})
        else:
            await self.llm.abort(request_id)

    async def _release(self, request_id: str) -> None:
        if self.leases.pop(request_id, None) is None:
            return
        self.kv_server.withdraw(request_id)  # no peer reads them from now on
        # Freed once no send still reads them (at once, unless a peer stopped reading), in a task of its own:
        # neither the Release's answer nor the lease expiry of other requests waits for a stuck peer.
        task = asyncio.create_task(self._free_when_sent(request_id))
        self._freeing[request_id] = task
        task.add_done_callback(lambda _: self._freeing.pop(request_id, None))

    async def _free_when_sent(self, request_id: str) -> None:
        if not await self.kv_server.wait_sent(request_id, self.service.transport.transfer_timeout):
            logger.warning("%s: blocks of %s were still being sent to a peer that stopped reading; cut it off",
                           self.service.engine_id, request_id)
        self.llm.release_kv(request_id)  # freed at the engine's next step boundary

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.service.lease_seconds / 4))
            now = time.monotonic()
            for rid in [r for r, deadline in self.leases.items() if deadline < now]:
                logger.warning("request %s: KV lease expired before decode released it", rid)
                self.metrics.expired_leases.inc()
                await self._release(rid)

    async def close(self) -> None:
        if self._lease_task:
            self._lease_task.cancel()
        for task in list(self._freeing.values()):
            task.cancel()
        await self.kv_server.close()
        await super().close()
