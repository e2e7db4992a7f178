"""One request's life across the services: encode -> prefill -> decode (or unified, or decode alone).

1. Images go to encoders (by mm_hash affinity), which keep their embeddings for prefill to pull.
2. Prefill (chosen by prefix affinity) computes the prompt, samples the first token - streamed to the
   client at once - and holds the KV under a lease.
3. Decode (chosen by free KV and load) pulls the blocks it lacks, releases prefill, and streams the rest
   back to this proxy's inbox (a pull channel every service pushes TokenDeltas to).

Short uncached prompts, or no healthy prefill, go straight to decode, which prefills them itself. A
service call that fails at the transport level is retried on another instance as long as nothing of its
step has reached the client; a 4xx-kind refusal is never retried. Leaving the stream early (client gone,
stop string) aborts the request on every service that holds it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from epdserve.services.network import advertised
from epdserve.services.proxy.generation import Chunk, GenerateInput, GenerationError
from epdserve.services.proxy.router import Instance, NoInstanceError, Router, prefix_key
from epdserve.shared.protocol import (Abort, Ack, DecodeRequest, EncodeDone, EncodeRequest, Error, ErrorCode,
                                      GenerateRequest, MMItem, MMPlaceholder, PrefillDone, PrefillRequest, Role,
                                      TokenDelta, TokenLogprobs as WireLogprobs)
from epdserve.shared.sampler import TokenLogprobs
from epdserve.shared.sampling_params import to_wire
from epdserve.transport.queues import ChannelError, ErrorReply, PullChannel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    # Prompts with fewer tokens than this are prefilled by decode itself (0: always disaggregate).
    local_prefill_threshold: int = 0
    max_attempts: int = 3  # instances tried for one step before giving up
    request_timeout: float = 30.0  # a control request (encode, accept a decode...)
    prefill_timeout: float = 600.0  # a whole prefill (long prompts on CPU take a while)
    token_timeout: float = 600.0  # silence allowed between two chunks of a stream
    liveness_check: float = 0.5  # how often a waiting stream checks its instance is still alive


def _chunk_logprobs(wire: tuple[WireLogprobs, ...] | list) -> list[TokenLogprobs]:
    return [TokenLogprobs(w.logprob, 0, list(zip(w.top_token_ids, w.top_logprobs))) for w in wire]


def _refusal(exc: ErrorReply) -> GenerationError | None:
    """The HTTP error for a service's refusal that no other instance would answer differently."""
    if exc.error.code == ErrorCode.BAD_REQUEST:
        return GenerationError(exc.error.message, 400, "BadRequestError")
    return None


class ServiceBackend:
    """Runs requests on the services the router knows; implements the OpenAI layer's Backend."""

    def __init__(self, router: Router, inbox: PullChannel, config: LifecycleConfig, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None) -> None:
        self.router = router
        self.inbox = inbox
        self.config = config
        self._bind_host, self._advertise_host = bind_host, advertise_host
        self.reply_to = ""  # the inbox as services dial it
        self._streams: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._aborts: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.reply_to = advertised(await self.inbox.start(), self._bind_host, self._advertise_host)
        self._task = asyncio.create_task(self._dispatch())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.inbox.close()

    async def _dispatch(self) -> None:
        """Deliver what services push to the stream of the request it belongs to. Tokens of a request
        nobody waits for any more (it ended here while the service went on) get that request aborted."""
        orphans: collections.OrderedDict[str, None] = collections.OrderedDict()
        while True:
            message, peer = await self.inbox.recv_from()
            rid = getattr(message, "request_id", None) or ""
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(message)
            elif rid not in orphans and not (isinstance(message, TokenDelta) and message.finish_reason):
                orphans[rid] = None
                if len(orphans) > 1024:
                    orphans.popitem(last=False)
                self._abort_soon(self.router.find(peer.engine_id), rid)

    # -- the request ---------------------------------------------------------------------------------
    async def generate(self, gen: GenerateInput) -> AsyncIterator[Chunk]:
        if self.router.disaggregated and not self.router.pool(Role.DECODE).healthy():
            # Checked first: prefill would otherwise stream a first token that nobody can continue.
            raise GenerationError("no healthy decode instance", 503, "ServiceUnavailableError")
        placeholders = await self._encode(gen) if gen.images else ()
        if not self.router.disaggregated:
            stream = self._generate_on(Role.UNIFIED, gen, placeholders)
        elif len(gen.prompt_token_ids) < self.config.local_prefill_threshold or \
                not self.router.pool(Role.PREFILL).healthy():
            stream = self._generate_on(Role.DECODE, gen, placeholders)
        else:
            stream = self._disaggregated(gen, placeholders)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def _encode(self, gen: GenerateInput) -> tuple[MMPlaceholder, ...]:
        pool = self.router.pool(Role.ENCODER)
        if not pool.configured:
            raise GenerationError("this deployment has no encoder: image inputs are not served", 400,
                                  "BadRequestError")
        placeholders = []
        for image in gen.images:
            for attempt, instance in self._candidates(Role.ENCODER, image.mm_hash.encode()):
                try:
                    done = await instance.client.request(
                        EncodeRequest(gen.request_id, (MMItem(image.mm_hash, image.data),)),
                        timeout=self.config.request_timeout, expect=EncodeDone)
                    break
                except ErrorReply as exc:
                    if (refused := _refusal(exc)) is not None:
                        raise refused from None
                    self._give_up_after(attempt, Role.ENCODER, exc)
                except (ChannelError, TimeoutError) as exc:
                    pool.mark_failed(instance)
                    self._give_up_after(attempt, Role.ENCODER, exc)
            if done.items[0].num_tokens != image.length:
                raise GenerationError(f"the encoder made {done.items[0].num_tokens} embeddings for an image with "
                                      f"{image.length} placeholder tokens", 500)
            placeholders.append(MMPlaceholder(image.offset, image.length, image.mm_hash, instance.data_addr))
        return tuple(placeholders)

    def _candidates(self, role: Role, key: bytes | None):
        """Up to max_attempts distinct healthy instances, best first."""
        pool = self.router.pool(role)
        tried: list[Instance] = []
        for attempt in range(self.config.max_attempts):
            try:
                instance = pool.pick_affine(key, tried) if key is not None else pool.pick_least_loaded(tried)
            except NoInstanceError:
                if not tried:
                    raise GenerationError(f"no healthy {role.value} instance", 503, "ServiceUnavailableError")
                raise GenerationError(f"every {role.value} instance tried failed", 503, "ServiceUnavailableError")
            tried.append(instance)
            yield attempt, instance

    def _give_up_after(self, attempt: int, role: Role, exc: Exception) -> None:
        logger.warning("%s call failed (attempt %d): %s", role.value, attempt + 1, exc)
        if attempt + 1 >= self.config.max_attempts:
            raise GenerationError(f"{role.value} failed: {exc}", 503, "ServiceUnavailableError")

    async def _disaggregated(self, gen: GenerateInput, placeholders) -> AsyncIterator[Chunk]:
        wire = to_wire(gen.params)
        key = prefix_key(gen.prompt_token_ids, gen.cache_salt)
        prefill = None
        for attempt, instance in self._candidates(Role.PREFILL, key):
            instance.inflight += 1
            try:
                done = await instance.client.request(
                    PrefillRequest(gen.request_id, tuple(gen.prompt_token_ids), wire, placeholders, gen.cache_salt),
                    timeout=self.config.prefill_timeout, expect=PrefillDone)
                prefill = instance
                break
            except ErrorReply as exc:
                if (refused := _refusal(exc)) is not None:
                    raise refused from None
                self._give_up_after(attempt, Role.PREFILL, exc)
            except (ChannelError, TimeoutError) as exc:
                self.router.pool(Role.PREFILL).mark_failed(instance)
                self._abort_soon(instance, gen.request_id)
                self._give_up_after(attempt, Role.PREFILL, exc)
            finally:
                instance.inflight -= 1
        first = Chunk([done.first_token], _chunk_logprobs([done.first_logprobs] if done.first_logprobs else []),
                      done.finish_reason.value if done.finish_reason else None, None, done.num_cached_tokens)
        if done.kv_handle is None:
            yield first
            return
        finished = False
        try:
            yield first
            request = DecodeRequest(gen.request_id, tuple(gen.prompt_token_ids), done.first_token, done.kv_handle,
                                    wire, placeholders, gen.cache_salt, self.reply_to)
            async for chunk in self._stream_from(Role.DECODE, request, None):
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:  # decode may not have pulled (and released) the KV: free it now, not at lease end
                self._abort_soon(prefill, gen.request_id)

    async def _generate_on(self, role: Role, gen: GenerateInput, placeholders) -> AsyncIterator[Chunk]:
        request = GenerateRequest(gen.request_id, tuple(gen.prompt_token_ids), to_wire(gen.params),
                                  self.reply_to, placeholders, gen.cache_salt)
        key = prefix_key(gen.prompt_token_ids, gen.cache_salt) if role == Role.UNIFIED else None
        async for chunk in self._stream_from(role, request, key):
            yield chunk

    async def _stream_from(self, role: Role, request, key: bytes | None) -> AsyncIterator[Chunk]:
        """Send `request` to an instance of `role` that accepts it, then yield what it pushes back."""
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        instance = None  # counts it in its load; from the moment it may have accepted it, hears of an abort
        finished = False
        try:
            for attempt, candidate in self._candidates(role, key):
                instance = candidate
                # Load counted from the pick, not from the answer: requests routed at the same moment
                # (a prefill batch finishing together) must see each other.
                candidate.inflight += 1
                try:
                    await candidate.client.request(request, timeout=self.config.request_timeout, expect=Ack)
                    break
                except ErrorReply as exc:
                    candidate.inflight -= 1
                    instance = None  # refused: it holds nothing
                    if (refused := _refusal(exc)) is not None:
                        raise refused from None
                    self._give_up_after(attempt, role, exc)
                except (ChannelError, TimeoutError) as exc:
                    candidate.inflight -= 1
                    self.router.pool(role).mark_failed(candidate)
                    self._abort_soon(candidate, rid)  # in case it did accept and only the answer was lost
                    instance = None
                    self._give_up_after(attempt, role, exc)
            while not finished:
                message = await self._next(queue, instance)
                if isinstance(message, Error):
                    status = 400 if message.code == ErrorCode.BAD_REQUEST else 502
                    raise GenerationError(f"{role.value} {instance.address}: {message.message}", status)
                assert isinstance(message, TokenDelta)
                finished = message.finish_reason is not None
                yield Chunk(list(message.token_ids), _chunk_logprobs(message.logprobs),
                            message.finish_reason.value if finished else None, message.stop_reason,
                            message.num_cached_tokens)
        finally:
            self._streams.pop(rid, None)
            if instance is not None:
                instance.inflight -= 1
                if not finished:
                    self._abort_soon(instance, rid)

    async def _next(self, queue: asyncio.Queue, instance: Instance):
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(queue.get(), self.config.liveness_check)
            except asyncio.TimeoutError:
                waited += self.config.liveness_check
            if not instance.alive:
                raise GenerationError(f"{instance.role.value} instance {instance.address} stopped answering", 502,
                                      "BadGatewayError")
            if waited > self.config.token_timeout:
                raise GenerationError(f"no tokens from {instance.address} for {waited:.0f}s", 504, "TimeoutError")

    def _abort_soon(self, instance: Instance | None, request_id: str) -> None:
        """Abort in a task of its own: cleanup runs while the request's task is being cancelled (client
        gone), where any await of ours would be cancelled too."""
        task = asyncio.get_running_loop().create_task(self._abort(instance, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, instance: Instance | None, request_id: str) -> None:
        if instance is None or not instance.alive:
            return
        try:
            await instance.client.request(Abort(request_id), timeout=self.config.request_timeout, expect=Ack)
        except (ChannelError, TimeoutError) as exc:
            logger.warning("abort of %s at %s failed: %s", request_id, instance.address, exc)
