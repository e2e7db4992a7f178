"""One request's life across the services: encode -> prefill -> decode (or unified, or decode alone).

1. Images go to encoders (by mm_hash affinity), which keep their embeddings for prefill to pull.
2. Prefill (chosen by the prompt blocks it caches and its load) computes the prompt, samples the first
   token - streamed to the client at once - and holds the KV under a lease.
3. Decode (chosen likewise) pulls the blocks it lacks, releases prefill, and streams the rest back to
   this proxy's inbox (a pull channel services push a step's TokenDeltas to, one message per step).

Short uncached prompts, or no healthy prefill, go straight to decode, which prefills them itself.

Routing is KV-aware by default (kv_routing.py): the router's prefix index knows which instance holds
which blocks (the engines' KV events), so prefill and decode are each chosen by the prompt blocks they
hold weighed against their load, and a decode that already holds all but a few tokens of the prompt (a
chat's next turn) prefills the rest itself, with nothing transferred. Every such decision is counted by
path and reason (`routed`). `--routing-policy load` chooses by load alone: prefill by a hash of the
prompt's head, decode by free blocks and load.

Every call to a service (encode, prefill, start a stream) goes through one failover path
(`failover.Failover`): instances tried best first, their liveness watched while they work, a refusal the
request may have caused never retried - only before anything of that step reached the client. A client
that goes away cancels the request's task: whatever a service may have accepted is aborted there, and
leaving a stream early (client gone, stop string) aborts the request on every service that holds it.
When the proxy's drain grace runs out (`cut`), every request still waiting on a service ends the same way,
with the cut's error.

An engine that cannot have a request's image embeddings from the encoder that made them (the encoder died,
or was cut off, after encoding) answers `embeddings_unavailable` within seconds: the images are encoded
again, on a live encoder, and the request sent once more, at most `max_attempts - 1` times and only before
anything reached the client (`epdserve:request_reencodes_total`); otherwise the client gets a 503.

A stream whose decode (or unified instance) is lost after it accepted the request - died, cut off,
drained past its grace - continues on another one from the tokens already delivered (migration.py). A stream
takes tokens only from the instance that accepted it: one its call failed over from may come back (frozen,
then thawed) still running the request under the same id, and has it aborted instead.

The spans services return (EncodeDone, PrefillDone, a stream's first TokenDelta), with `proxy.encode`,
`proxy.prefill` (each call as this proxy waited for it) and `proxy.migrate`, ride on the chunks to the
OpenAI layer, which assembles the request's trace (tracing.py).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, NamedTuple

from epdserve.services.runtime.network import advertised
from epdserve.services.proxy.choices import merge
from epdserve.services.proxy.failover import (EmbeddingsUnavailable, Failover, InstanceDown, Liveness, service_error,
                                              watched)
from epdserve.services.proxy import kv_routing, prefill_queue
from epdserve.services.proxy.generation import Chunk, GenerateInput, GenerationError
from epdserve.services.proxy.kv_routing import KVRoutingConfig, RoutingPolicy
from epdserve.services.proxy.migration import Progress, StreamLost
from epdserve.services.proxy.router import Instance, Route, Router, prefix_key
from epdserve.transport.channel.protocol import (Abort, Ack, DecodeRequest, EncodeDone, EncodeRequest, Error,
                                                 ErrorCode, GenerateRequest, HoldCheck, Message, MMItem, MMPlaceholder,
                                                 PrefillDone, PrefillRequest, Role, TokenDelta, TokenDeltas, TraceSpan)
from epdserve.shared.block_hash import extend_block_hashes
from epdserve.services.host.wire import mrope_positions_to_wire, sampling_params_to_wire
from epdserve.shared.engine import sequence_seed
from epdserve.transport.channel.common import ChannelError, ErrorReply
from epdserve.transport.channel.reply_server import PullChannel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    # Prompts with fewer tokens than this are prefilled by decode itself (0: always disaggregate).
    local_prefill_threshold: int = 0
    # Prompts of at most this many tokens are prefilled by a decode while every prefill has as many queued and
    # the decode fewer (prefill_queue.py; 0: never).
    max_prefill_queue_tokens: int = 1024
    max_attempts: int = 3  # instances tried for one step before giving up
    rpc_timeout: float = 30.0  # a control request (encode, accept a decode...)
    prefill_timeout: float = 600.0  # a whole prefill (long prompts on CPU take a while)
    token_timeout: float = 600.0  # silence allowed between two chunks of a stream
    # Silence after which a stream asks its instance whether it still runs the request (HoldCheck): pushes are at
    # most once, and a stream whose last delta was lost waits for nothing.
    hold_check: float = 5.0
    liveness_check: float = 0.5  # how often a waiting call or stream checks its instance is still alive
    # How long a call or a lost stream waits, with no instance left, for one whose connection dropped to answer a
    # poll again (a few of the router's polls: a stall past the heartbeats, a restart).
    reconnect_grace: float = 3.0
    migration_limit: int = 3  # times one request's stream may continue on another instance (migration.py)
    kv_routing: KVRoutingConfig = field(default_factory=KVRoutingConfig)
    # The deployment's block-hash key (shared/block_hash.py): engines hash their blocks with it, so must the
    # router that matches a prompt's blocks against their KV events. None: unkeyed.
    block_hash_key: bytes | None = field(default=None, repr=False)


class _Plan(NamedTuple):
    """Where one request goes: its path, why, and how each role's instance is chosen."""
    path: str  # prefill_decode | decode_only | unified
    reason: str
    route: Route  # decode and unified
    prefill_route: Route


# Put on every stream's queue by `cut`: wakes a stream waiting for its next tokens.
_CUT = object()


class ServiceBackend:
    """Runs requests on the services the router knows; implements the OpenAI layer's Backend."""

    def __init__(self, router: Router, inbox: PullChannel, config: LifecycleConfig, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, routed: Callable[[str, str], None] = lambda path, reason: None,
                 engine_id: str = "proxy", migrated: Callable[[str], None] = lambda reason: None,
                 reencoded: Callable[[], None] = lambda: None) -> None:
        self.router = router
        self.engine_id = engine_id  # on the proxy's own spans
        self.routed = routed  # (path, reason) of each request, for the metrics
        self.migrated = migrated  # (reason) of each migration, for the metrics
        self.reencoded = reencoded  # each request whose images are encoded again, for the metrics
        self.inbox = inbox
        self.config = config
        self._bind_host, self._advertise_host = bind_host, advertise_host
        self.reply_to = ""  # the inbox as services dial it
        self._streams: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._aborts: set[asyncio.Task] = set()
        self._cut: GenerationError | None = None  # set once: every wait on a service ends with it
        self._failover = Failover(router, self._abort_soon, config.max_attempts, config.liveness_check,
                                  self._check_cut, config.reconnect_grace)

    async def start(self) -> None:
        self.reply_to = advertised(await self.inbox.start(), self._bind_host, self._advertise_host)
        self._task = asyncio.create_task(self._dispatch())

    def cut(self, error: GenerationError) -> None:
        """End every request now with `error` (the proxy's drain grace ran out): streams at once, calls
        to services at their next liveness check; each is aborted where it runs."""
        self._cut = error
        for queue in self._streams.values():
            queue.put_nowait(_CUT)

    def _check_cut(self) -> None:
        cut = self._cut
        if cut is not None:  # a fresh exception for each request: each gets its own traceback
            raise GenerationError(str(cut), cut.status, cut.error_type)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.inbox.close()

    async def _dispatch(self) -> None:
        """Deliver what services push to the stream of the request it belongs to, with the sender's engine id.
        Tokens of a request nobody waits for any more (it ended here while the service went on) get that
        request aborted."""
        orphans: collections.OrderedDict[str, None] = collections.OrderedDict()
        while True:
            message, peer = await self.inbox.recv_from()
            # A step's deltas for this proxy's requests come as one message.
            for item in message.deltas if isinstance(message, TokenDeltas) else (message,):
                rid = getattr(item, "request_id", None) or ""
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait((peer.engine_id, item))
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
        spans: list[TraceSpan] = []  # the encoders', and proxy.encode: they ride on the first chunk
        placeholders = await self._encode(gen, spans) if gen.images else ()
        stream = self._start(gen, placeholders)
        progress = Progress(gen.params.n)
        hops = reencodes = 0
        try:
            while True:
                try:
                    async for chunk in stream:
                        if spans:
                            chunk, spans = chunk._replace(trace=(*spans, *chunk.trace)), []
                        progress.record(chunk)
                        yield chunk
                    return
                except EmbeddingsUnavailable as lost:
                    # The images' encoder went away before an engine had their embeddings: encoded again (by a
                    # live encoder) the request starts over - while nothing of it reached the client yet.
                    if progress.delivered or reencodes == self.config.max_attempts - 1 or self._cut is not None:
                        raise
                    reencodes += 1
                    logger.warning("request %s: %s; encoding its images again (%d of at most %d)", gen.request_id,
                                   lost, reencodes, self.config.max_attempts - 1)
                    self.reencoded()
                    await stream.aclose()
                    placeholders = await self._encode(gen, spans)
                    stream = self._start(gen, placeholders)
                except StreamLost as lost:
                    if not progress.unfinished():
                        return
                    role = Role.DECODE if self.router.disaggregated else Role.UNIFIED
                    if hops == self.config.migration_limit or self._cut is not None or \
                            not await self._failover.within_grace(lambda: self.router.pool(role).healthy() or None):
                        raise
                    hops += 1
                    logger.warning("request %s: %s; continuing it elsewhere (migration %d of at most %d)",
                                   gen.request_id, lost, hops, self.config.migration_limit)
                    self.migrated(lost.reason)
                    await stream.aclose()
                    stream = self._migrate(role, gen, placeholders, progress, hops, lost.reason)
        finally:
            await stream.aclose()

    def _start(self, gen: GenerateInput, placeholders: tuple[MMPlaceholder, ...]) -> AsyncIterator[Chunk]:
        """`gen`'s stream along the path its plan chooses (counted in the metrics)."""
        plan = self._plan(gen, placeholders)
        self.routed(plan.path, plan.reason)
        if plan.path == "prefill_decode":
            return self._disaggregated(gen, placeholders, plan)
        return self._generate_on(Role.UNIFIED if plan.path == "unified" else Role.DECODE, gen, placeholders,
                                 plan.route)

    def _migrate(self, role: Role, gen: GenerateInput, placeholders, progress: Progress, hop: int,
                 reason: str) -> AsyncIterator[Chunk]:
        """The rest of `gen` after what `progress` says was delivered: each unfinished sequence continued on an
        instance of `role` that computes (or finds cached) the prompt and the tokens so far."""
        route = self._plan(gen, placeholders).route
        params = replace(gen.params, prompt_logprobs=None)  # scored and delivered with the first token
        lost_at = time.time()
        streams = []
        for index in progress.unfinished():
            sequence = params if params.n == 1 else replace(params, n=1, seed=sequence_seed(params.seed, index))
            request = GenerateRequest(f"{gen.request_id}.m{hop}.{index}", tuple(gen.prompt_token_ids),
                                      sampling_params_to_wire(sequence), self.reply_to, placeholders, gen.cache_salt,
                                      tuple(progress.tokens[index]), mrope_positions_to_wire(gen.mrope_positions),
                                      gen.lora)
            streams.append(self._continued(role, request, route, index, f"proxy.migrate:{reason}", lost_at))
        return merge(streams)

    async def _continued(self, role: Role, request: GenerateRequest, route: Route, index: int, span: str,
                         lost_at: float) -> AsyncIterator[Chunk]:
        """Sequence `index` of a request, continued by `request`: its chunks as the original stream's."""
        first = True
        async for chunk in self._stream_from(role, request, route, len(request.prompt_token_ids)
                                             + len(request.output_token_ids)):
            trace = (TraceSpan(span, self.engine_id, lost_at, time.time()), *chunk.trace) if first else chunk.trace
            first = False
            yield chunk._replace(index=index, num_cached_tokens=None, prompt_logprobs=None, trace=trace)

    def _span(self, name: str, start: float) -> TraceSpan:
        """A span of this proxy's from `start` (Unix seconds) until now."""
        return TraceSpan(name, self.engine_id, start, time.time())

    def _plan(self, gen: GenerateInput, placeholders: tuple[MMPlaceholder, ...]) -> _Plan:
        prompt = gen.prompt_token_ids
        # An adapter's blocks are hashed under its digest, which only engines know: its requests are routed
        # by load among the instances that have read the adapter, never by the base model's cached blocks.
        lora = gen.lora.name if gen.lora is not None else None
        affinity = Route(key=prefix_key(prompt, gen.cache_salt), lora=lora)
        index, kv = self.router.index, self.config.kv_routing
        route, reason = Route(lora=lora), "load"
        if kv.policy is RoutingPolicy.KV and index is not None and index.block_size is not None and lora is None:
            hashes = extend_block_hashes([], prompt, index.block_size, placeholders, gen.cache_salt,
                                         key=self.config.block_hash_key)
            cached, elsewhere = index.match_weighted(hashes, kv.tier_weight, kv.store_weight)
            route = affinity = Route(affinity.key, cached, len(hashes), kv.load_weight, elsewhere)
            reason = "cached_prefix" if cached else "no_cached_prefix"
        if not self.router.disaggregated:
            return _Plan("unified", reason if route.cached is not None else "prefix_affinity", affinity, affinity)
        if len(prompt) < self.config.local_prefill_threshold:
            return _Plan("decode_only", "short_prompt", route, affinity)
        prefills = self.router.pool(Role.PREFILL).healthy()
        if not prefills:
            return _Plan("decode_only", "no_prefill", route, affinity)
        decodes = self.router.pool(Role.DECODE).healthy()
        if route.cached:
            _, held = kv_routing.pick(decodes, route.cached, route.prompt_blocks, route.load_weight, route.key,
                                      route.elsewhere)
            if held and len(prompt) - held * index.block_size <= kv.local_prefill_tokens:
                return _Plan("decode_only", "decode_holds_prefix", route, affinity)
        if prefill_queue.prefill_on_decode(len(prompt), (p.queued_prompt_tokens for p in prefills),
                                           (d.queued_prompt_tokens for d in decodes),
                                           self.config.max_prefill_queue_tokens):
            return _Plan("decode_only", prefill_queue.REASON, route, affinity)
        return _Plan("prefill_decode", reason, route, affinity)

    async def _encode(self, gen: GenerateInput, spans: list[TraceSpan]) -> tuple[MMPlaceholder, ...]:
        if not self.router.pool(Role.ENCODER).configured:
            raise GenerationError("this deployment has no encoder: image inputs are not served", 400,
                                  "BadRequestError")
        placeholders = []
        for image in gen.images:
            request = EncodeRequest(gen.request_id, (MMItem(image.mm_hash, image.data),))
            started = time.time()
            instance, done = await self._failover.call(Role.ENCODER, Route(key=image.mm_hash.encode()), request,
                                                       self.config.rpc_timeout, EncodeDone)
            spans += [self._span("proxy.encode", started), *done.trace]
            if done.items[0].num_tokens != image.length:
                raise GenerationError(f"the encoder made {done.items[0].num_tokens} embeddings for an image with "
                                      f"{image.length} placeholder tokens", 500)
            placeholders.append(MMPlaceholder(image.offset, image.length, image.mm_hash, instance.data_addr))
        return tuple(placeholders)

    async def _disaggregated(self, gen: GenerateInput, placeholders, plan: _Plan) -> AsyncIterator[Chunk]:
        wire = sampling_params_to_wire(gen.params)
        started = time.time()
        prefill, done = await self._failover.call(
            Role.PREFILL, plan.prefill_route,
            PrefillRequest(gen.request_id, tuple(gen.prompt_token_ids), wire, placeholders, gen.cache_salt,
                           mrope_positions_to_wire(gen.mrope_positions), gen.lora),
            self.config.prefill_timeout, PrefillDone, len(gen.prompt_token_ids))
        first = Chunk([done.first_token], [done.first_logprobs] if done.first_logprobs else [],
                      done.finish_reason.value if done.finish_reason else None, None, done.num_cached_tokens,
                      list(done.prompt_logprobs) if done.prompt_logprobs else None,
                      trace=(self._span("proxy.prefill", started), *done.trace))
        # n > 1: every sequence's first token, sampled by prefill from the one prefill of the prompt.
        firsts = [first] + [Chunk([f.token_id], [f.logprobs] if f.logprobs else [],
                                  f.finish_reason.value if f.finish_reason else None, index=i)
                            for i, f in enumerate(done.other_first_tokens, 1)]
        if done.kv_handle is None:
            for chunk in firsts:
                yield chunk
            return
        finished = False
        try:
            for chunk in firsts:
                yield chunk
            # Prefill scored the prompt: decode, even when it recomputes the prompt, must not do it again.
            request = DecodeRequest(gen.request_id, tuple(gen.prompt_token_ids), done.first_token, done.kv_handle,
                                    replace(wire, prompt_logprobs=None), placeholders, gen.cache_salt, self.reply_to,
                                    other_first_tokens=tuple(f.token_id for f in done.other_first_tokens),
                                    mrope_positions=mrope_positions_to_wire(gen.mrope_positions), lora=gen.lora)
            unfinished = set(range(gen.params.n))
            async for chunk in self._stream_from(Role.DECODE, request, plan.route):
                if chunk.finish_reason is not None:
                    unfinished.discard(chunk.index)
                finished = not unfinished
                yield chunk
        finally:
            if not finished:  # decode may not have pulled (and released) the KV: free it now, not at lease end
                self._abort_soon(prefill, gen.request_id)

    async def _generate_on(self, role: Role, gen: GenerateInput, placeholders, route: Route) -> AsyncIterator[Chunk]:
        request = GenerateRequest(gen.request_id, tuple(gen.prompt_token_ids), sampling_params_to_wire(gen.params),
                                  self.reply_to, placeholders, gen.cache_salt,
                                  mrope_positions=mrope_positions_to_wire(gen.mrope_positions), lora=gen.lora)
        async for chunk in self._stream_from(role, request, route, len(request.prompt_token_ids)):
            yield chunk

    async def broadcast(self, message: Message) -> list[tuple[str, str | None]]:
        """Send `message` to every healthy engine instance (prefill, decode, unified) at once: (engine id, the
        error it answered or None) for each."""
        instances = [i for role in (Role.PREFILL, Role.DECODE, Role.UNIFIED)
                     for i in self.router.pool(role).healthy()]

        async def one(instance) -> tuple[str, str | None]:
            name = instance.status.engine_id if instance.status else instance.address
            try:
                await instance.client.request(message, timeout=self.config.rpc_timeout, expect=Ack)
            except ErrorReply as exc:
                return name, exc.error.message
            except ChannelError as exc:
                return name, f"unreachable ({exc})"
            return name, None

        return list(await asyncio.gather(*(one(i) for i in instances)))

    async def _stream_from(self, role: Role, request, route: Route, prompt_tokens: int = 0) -> AsyncIterator[Chunk]:
        """Send `request` to an instance of `role` that accepts it, then yield what it pushes back, until
        every one of its sequences (n) has finished. `prompt_tokens`: what the instance prefills for it, in
        its prompt queue until the first message back."""
        rid = request.request_id
        # Each sequence's output tokens so far: a decode continues from prefill's first token, a migrated
        # request from those delivered. A delta that does not start there follows one that was lost.
        received = dict.fromkeys(range(request.sampling_params.n), 1 if isinstance(request, DecodeRequest)
                                 else len(request.output_token_ids))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        instance = None  # from its acceptance: counts the stream in its load, hears of an abort
        finished = False
        unfinished = set(range(request.sampling_params.n))
        try:
            instance, _ = await self._failover.call(role, route, request, self.config.rpc_timeout, Ack, prompt_tokens)
            # Counted again at once: no other routing decision happens in between.
            instance.start(prompt_tokens)
            liveness = Liveness(instance, self._check_cut)
            owner = instance.status.engine_id if instance.status is not None else None
            stale: set[str] = set()
            while not finished:
                item = await self._next(queue, liveness, rid)
                if item is _CUT:
                    self._check_cut()
                sender, message = item
                if owner is not None and sender != owner:
                    # An instance this call failed over from (frozen, then back) still runs the request under
                    # the same id: its tokens are not this stream's.
                    if sender not in stale:
                        stale.add(sender)
                        self._abort_soon(self.router.find(sender), rid)
                    continue
                if prompt_tokens:
                    instance.prefilled(prompt_tokens)
                    prompt_tokens = 0
                if isinstance(message, Error):
                    if message.code == ErrorCode.ABORTED:  # stopped by its instance, which is going away
                        raise StreamLost(f"{role.value} {instance.address}: {message.message}", "drained", 503,
                                         "ServiceUnavailableError")
                    raise service_error(message, instance)
                assert isinstance(message, TokenDelta)
                if received.get(message.index) != message.offset:
                    raise StreamLost(f"{role.value} instance {instance.address} sent tokens of sequence "
                                     f"{message.index} from {message.offset}, having sent "
                                     f"{received.get(message.index)}: a delta was lost on the way", "tokens_lost",
                                     502, "BadGatewayError")
                received[message.index] += len(message.token_ids)
                if message.finish_reason is not None:
                    unfinished.discard(message.index)
                finished = not unfinished
                yield Chunk(list(message.token_ids), list(message.logprobs),
                            message.finish_reason.value if message.finish_reason else None, message.stop_reason,
                            message.num_cached_tokens, list(message.prompt_logprobs) or None, message.index,
                            message.trace)
        finally:
            self._streams.pop(rid, None)
            if instance is not None:
                instance.end(prompt_tokens)
                if not finished:
                    self._abort_soon(instance, rid)

    async def _next(self, queue: asyncio.Queue, liveness: Liveness, request_id: str):
        if self._cut is not None:
            return _CUT
        if not queue.empty():  # the common case under load: no waiting, no task
            return queue.get_nowait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.token_timeout
        interval = self.config.liveness_check
        try:
            while True:
                try:
                    return await watched(queue.get(), liveness, interval,
                                         min(self.config.hold_check, deadline - loop.time()))
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise GenerationError(f"no tokens from {liveness.instance.address} for "
                                              f"{self.config.token_timeout:.0f}s", 504, "TimeoutError") from None
                # Watched too: a frozen instance answers nothing, and its liveness says so sooner than a timeout.
                if not await watched(self._holds(liveness.instance, request_id), liveness, interval):
                    # Its stream ended there, and what it pushed last never came - or is still on its way.
                    try:
                        return await asyncio.wait_for(queue.get(), interval)
                    except TimeoutError:
                        raise StreamLost(f"{liveness.instance.address} no longer runs the request, and the end of "
                                         "its stream never came", "tokens_lost", 502, "BadGatewayError") from None
        except InstanceDown as exc:
            raise StreamLost(str(exc), "instance_lost", 502, "BadGatewayError") from None

    async def _holds(self, instance: Instance, request_id: str) -> bool:
        """Whether `instance` still runs `request_id`'s stream; when it cannot say, the liveness checks decide."""
        try:
            await instance.client.request(HoldCheck(request_id), timeout=self.config.rpc_timeout, expect=Ack)
        except ErrorReply as exc:
            return exc.error.code is not ErrorCode.NOT_FOUND
        except (ChannelError, TimeoutError):
            pass
        return True

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
            await instance.client.request(Abort(request_id), timeout=self.config.rpc_timeout, expect=Ack)
        except (ChannelError, TimeoutError) as exc:
            logger.warning("abort of %s at %s failed: %s", request_id, instance.address, exc)
