"""One request's life across the services: encode -> prefill -> decode (or unified, or decode alone).

1. Images go to encoders (by mm_hash affinity), which keep their embeddings for prefill to pull.
2. Prefill (chosen by prefix affinity) computes the prompt, samples the first token - streamed to the
   client at once - and holds the KV under a lease.
3. Decode (chosen by free KV and load) pulls the blocks it lacks, releases prefill, and streams the rest
   back to this proxy's inbox (a pull channel services push a step's TokenDeltas to, one message per step).

Short uncached prompts, or no healthy prefill, go straight to decode, which prefills them itself.

Every call to a service goes through one failover path (`_send`): healthy instances are tried best
first; while one works on the request, its liveness is watched (router polls, the connection itself),
so a dead instance fails or fails over within seconds instead of at a timeout. An instance that died, a
lost connection or a retryable refusal (starting, draining, overloaded) moves on to the next instance -
only before anything of that step reached the client. A refusal the request itself may have caused (bad
input; an internal error of an instance that is still alive) is never retried: it could take every
instance down in turn. Leaving the stream early (client gone, stop string) aborts the request on every
service that holds it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from epdserve.services.network import advertised
from epdserve.services.proxy.generation import Chunk, GenerateInput, GenerationError
from epdserve.services.proxy.router import Instance, NoInstanceError, Router, prefix_key
from epdserve.shared.protocol import (Abort, Ack, DecodeRequest, EncodeDone, EncodeRequest, Error, ErrorCode,
                                      GenerateRequest, MMItem, MMPlaceholder, PrefillDone, PrefillRequest, Role,
                                      TokenDelta, TokenDeltas, TokenLogprobs as WireLogprobs)
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


class InstanceDown(ChannelError):
    """The instance working on a request was found dead while we waited for it."""


def _service_error(error: Error, instance: Instance) -> GenerationError:
    if error.code == ErrorCode.BAD_REQUEST:
        return GenerationError(error.message, 400, "BadRequestError")
    return GenerationError(f"{instance.role.value} {instance.address}: {error.message}", 500)


def _final(exc: ErrorReply, instance: Instance) -> GenerationError | None:
    """The client's error for a refusal that no other instance would answer differently; None when another
    instance may succeed (the refusal says so, or this instance is dead)."""
    if exc.error.code != ErrorCode.BAD_REQUEST and (exc.error.retryable or not instance.alive):
        return None
    return _service_error(exc.error, instance)


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
            # A step's deltas for this proxy's requests come as one message.
            for item in message.deltas if isinstance(message, TokenDeltas) else (message,):
                rid = getattr(item, "request_id", None) or ""
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait(item)
                elif rid not in orphans and not (isinstance(item, TokenDelta) and item.finish_reason):
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
        if not self.router.pool(Role.ENCODER).configured:
            raise GenerationError("this deployment has no encoder: image inputs are not served", 400,
                                  "BadRequestError")
        placeholders = []
        for image in gen.images:
            instance, done = await self._send(Role.ENCODER, image.mm_hash.encode(),
                                              EncodeRequest(gen.request_id, (MMItem(image.mm_hash, image.data),)),
                                              self.config.request_timeout, EncodeDone)
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

    async def _send(self, role: Role, key: bytes | None, message, timeout: float, expect: type) -> tuple[Instance, Any]:
        """Send `message` to healthy instances of `role`, best first, until one answers with `expect`:
        (that instance, its answer). The instance counts the message in its load while working on it."""
        last: Exception | None = None
        for attempt, instance in self._candidates(role, key):
            instance.inflight += 1
            try:
                return instance, await self._call(instance, message, timeout, expect)
            except ErrorReply as exc:
                if (final := _final(exc, instance)) is not None:
                    raise final from None
                last = exc
            except (ChannelError, TimeoutError) as exc:
                self.router.pool(role).mark_failed(instance)
                if role != Role.ENCODER:  # it may have accepted the request and lost only the answer
                    self._abort_soon(instance, message.request_id)
                last = exc
            finally:
                instance.inflight -= 1
            logger.warning("%s %s failed %s (attempt %d): %s", role.value, instance.address,
                           type(message).__name__, attempt + 1, last)
        raise GenerationError(f"{role.value} failed: {last}", 503, "ServiceUnavailableError")

    async def _call(self, instance: Instance, message, timeout: float, expect: type):
        """`message`'s answer from `instance`; raises InstanceDown as soon as the instance is known dead."""
        disconnects = instance.client.num_disconnects
        call = asyncio.ensure_future(instance.client.request(message, timeout=timeout, expect=expect))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.config.liveness_check)
                if done:
                    return call.result()
                self._check_alive(instance, disconnects)
        finally:
            call.cancel()

    @staticmethod
    def _check_alive(instance: Instance, disconnects: int) -> None:
        if not instance.alive or instance.client.num_disconnects != disconnects:
            raise InstanceDown(f"{instance.role.value} instance {instance.address} stopped answering")

    async def _disaggregated(self, gen: GenerateInput, placeholders) -> AsyncIterator[Chunk]:
        wire = to_wire(gen.params)
        prefill, done = await self._send(
            Role.PREFILL, prefix_key(gen.prompt_token_ids, gen.cache_salt),
            PrefillRequest(gen.request_id, tuple(gen.prompt_token_ids), wire, placeholders, gen.cache_salt),
            self.config.prefill_timeout, PrefillDone)
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
        instance = None  # from its acceptance: counts the stream in its load, hears of an abort
        finished = False
        try:
            instance, _ = await self._send(role, key, request, self.config.request_timeout, Ack)
            # Counted again at once: no other routing decision happens in between.
            instance.inflight += 1
            disconnects = instance.client.num_disconnects
            while not finished:
                message = await self._next(queue, instance, disconnects)
                if isinstance(message, Error):
                    raise _service_error(message, instance)
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

    async def _next(self, queue: asyncio.Queue, instance: Instance, disconnects: int):
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(queue.get(), self.config.liveness_check)
            except asyncio.TimeoutError:
                waited += self.config.liveness_check
            try:
                self._check_alive(instance, disconnects)
            except InstanceDown as exc:
                raise GenerationError(str(exc), 502, "BadGatewayError") from None
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
