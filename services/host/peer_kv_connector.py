"""`PeerKVConnector`: the engine's KV door (kv_connector.py) to its peers, for every engine role.

It keeps a prefill's finished requests' blocks for the decode that pulls them (the prefill worker exposes
them on its KV server, and releases them), and loads what a request's prompt needs from elsewhere: the KV
blocks the prefill that computed the prompt holds for it (a decode's requests), and image embeddings from
the encoders that hold them (any role, and only when a step must compute their positions: a prefix-cache hit
needs none, and a decode needs them only to recompute). The bytes move with the service's `KVTransferClient`
(ZMQ block connections, ZMQ frames or UCX), on the service's event loop; the engine's thread only asks and
is told.

One decode request's handoff, as its trace shows it:

    submitted --(waits in decode's queue for blocks: `decode.queue`; prefill's lease renewed)--> loading
      --blocks pulled (`kv.transfer`, `kv.handshake` when it connected first)--> prefill released --> decoding
      --pull failed, or no room within --transfer-timeout--> prefill released, prompt recomputed here
                                                                (`kv.recompute:<reason>`)

Prefill holds the blocks until decode releases them - after the pull, or at once when the request ends,
gives up or never needs them (its own prefix cache held the whole prompt) - or until its lease runs out.
The handoff's states are the transport's (`HandoffState`, transport/kv/states.py): EXPOSED while held,
FETCHING, then FETCHED or FAILED, and RELEASED once.

A fetch whose bytes landed corrupted (IntegrityError: their checksums differ from the sender's) is counted
in `transfer_integrity_failures_total` and made once more; a second mismatch fails the load like any other
failed pull: the prompt is recomputed here (`kv.recompute:integrity`), and a request whose image embeddings
cannot be had intact ends with an error. Corrupt bytes are never used.

Image embeddings that cannot be had at all - their encoder is gone (a refused connection fails the fetch at
once, an unreachable one within the client's connect timeout), evicted them, or sent them corrupted twice -
fail the request with `InputsUnavailableError`, which the worker answers as `embeddings_unavailable`: the proxy
encodes the image again, on a live encoder, and sends the request once more.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

from epdserve.services.host.request_spans import RequestSpans
from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.engine import KVConnector, KVLoad, LoadResult
from epdserve.transport.channel.common import ChannelError, ErrorReply
from epdserve.transport.channel.peer_pool import PeerPool
from epdserve.transport.channel.protocol import Ack, KVHandle, LeaseRenewed, Message, Release, RenewLease
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.kv.states import HandoffState
from epdserve.transport.kv.transfer import IntegrityError, TransferError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# What a pull from a peer fails with: the prompt is then recomputed here.
PULL_ERRORS = (TransferError, ChannelError, TimeoutError)
T = TypeVar("T")


@dataclass(slots=True)
class PeerSources:
    """A request's `kv_transfer_params`: where its prompt's KV and image embeddings may be had from, and
    whether its own KV is kept for a peer."""

    spans: RequestSpans
    kv_handle: KVHandle | None = None  # the prefill holding the prompt's KV (a decode's requests)
    hold_for_peer: bool = False  # keep the KV once finished, for a decode to pull (a prefill's requests)
    encoder_addrs: dict[str, str] = field(default_factory=dict)  # mm_hash -> the encoder's data address
    # Set on the event loop as the handoff goes: when the KV was in place, or why and when it failed.
    kv_ready: float | None = None
    failed: tuple[float, str] | None = None


class _Handoff:
    """A decode request's hold on prefill's blocks: the lease renewal, the pull's state (the transport's
    names: EXPOSED while held, FETCHING, FETCHED or FAILED, then RELEASED once, whatever the reason - pulled,
    failed, no room here in time, all cached here already, or the request ended)."""

    __slots__ = ("sources", "arrival", "renewal", "state")

    def __init__(self, sources: PeerSources, arrival: float) -> None:
        self.sources = sources
        self.arrival = arrival  # when the engine was told to expect it (monotonic)
        self.renewal: asyncio.Task | None = None
        self.state = HandoffState.EXPOSED


class PeerKVConnector(KVConnector):
    """See the module docstring. Owns its control clients to prefills (RenewLease, Release), one per prefill,
    opened on first use and closed once unused: prefills come and go, and its tasks on the service's event
    loop (`close` ends both). No tier: no stats, no KV events."""

    name = "peer"

    def __init__(self, client: KVTransferClient, metrics: ServiceMetrics, loop: asyncio.AbstractEventLoop,
                 transfer_timeout: float, dtype: "torch.dtype", control_client_kwargs: dict) -> None:
        """`control_client_kwargs`: how this service dials a peer's control channel (RequestClient's)."""
        self.client, self.metrics, self.loop = client, metrics, loop
        self.transfer_timeout, self.dtype = transfer_timeout, dtype
        self._prefills: PeerPool[str, RequestClient] = PeerPool(  # control address -> client
            lambda address: RequestClient(address, **control_client_kwargs), RequestClient.close)
        self._rpc_timeout = control_client_kwargs["timeout"]
        self._handoffs: dict[str, _Handoff] = {}  # request id -> its hold on prefill's blocks (event loop)
        self._gave_up: set[str] = set()  # read by the engine's thread
        self._tasks: set[asyncio.Task] = set()

    # -- the service's side (event loop) ------------------------------------------------------------
    def _expect(self, request_id: str, sources: PeerSources, arrival: float) -> None:
        handoff = self._handoffs[request_id] = _Handoff(sources, arrival)
        handoff.renewal = self._spawn(self._hold(request_id, handoff))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._prefills.close()

    # -- the engine's side (its thread) -------------------------------------------------------------
    def expect(self, request_id: str, kv_transfer_params: object) -> None:
        """A decode request (its sources name prefill's KV handle) is about to be added: from now, keep
        prefill's lease alive until its KV is pulled, and give up holding it if no room turns up here within
        the transfer timeout (on the event loop, before any load of it: the loop runs what this engine's
        thread hands it in order)."""
        if isinstance(kv_transfer_params, PeerSources) and kv_transfer_params.kv_handle is not None:
            self.loop.call_soon_threadsafe(self._expect, request_id, kv_transfer_params, time.monotonic())

    def num_loadable_tokens(self, request, num_local_tokens: int) -> int:
        sources = request.kv_transfer_params
        handle = sources.kv_handle if isinstance(sources, PeerSources) else None
        if handle is None or request.group_id in self._gave_up:
            return 0
        if num_local_tokens >= handle.num_tokens:  # this engine's prefix cache holds it all
            self.loop.call_soon_threadsafe(self._release, request.group_id)
            return 0
        return handle.num_tokens - num_local_tokens

    def can_load_embeddings(self, request, mm_hashes: tuple[str, ...]) -> bool:
        sources = request.kv_transfer_params
        return sources is not None and all(h in sources.encoder_addrs for h in mm_hashes)

    def request_finished(self, request) -> bool:
        sources = request.kv_transfer_params
        return sources is not None and sources.hold_for_peer

    def start_load(self, request, load: KVLoad) -> None:
        sources = request.kv_transfer_params
        # Peers know the request by its group's id (n > 1: the sequence that loads is one of n).
        self.loop.call_soon_threadsafe(self._spawn_load, request.group_id, sources, load)

    def request_ended(self, request) -> None:
        self.loop.call_soon_threadsafe(self._forget, request.group_id)

    # -- loads (event loop) -------------------------------------------------------------------------
    def _spawn_load(self, request_id: str, sources: PeerSources, load: KVLoad) -> None:
        self._spawn(self._load_blocks(request_id, sources, load) if load.block_ids
                    else self._load_embeddings(request_id, sources, load))

    async def _load_blocks(self, request_id: str, sources: PeerSources, load: KVLoad) -> None:
        started = time.monotonic()
        handoff = self._handoffs.get(request_id)
        sources.spans.add("decode.queue", handoff.arrival if handoff else started, started)
        if handoff is not None:
            handoff.state = HandoffState.FETCHING
        handle, metrics = sources.kv_handle, self.metrics
        remote = list(handle.block_ids[load.first_block:load.first_block + len(load.block_ids)])
        metrics.local_kv_hit_blocks.inc(load.first_block)
        try:
            result = await self._intact("kv", request_id, lambda: self.client.fetch_blocks(
                handle.kv_addr, request_id, remote, load.block_ids, generation=handle.generation,
                timeout=self.transfer_timeout))
        except PULL_ERRORS as exc:
            reason = failure_reason(exc)
            logger.warning("request %s: KV pull from %s failed (%s: %s); recomputing the prompt here",
                           request_id, handle.kv_addr, reason, exc)
            metrics.transfer_failures.inc()
            sources.spans.add("kv.transfer:failed", started, time.monotonic(), 0, len(remote))
            sources.failed = (time.monotonic(), reason)
            if handoff is not None:
                handoff.state = HandoffState.FAILED
            self._release(request_id)
            self.finish(LoadResult(load.request_id, False, reason))
            return
        if result.connect_seconds:  # this pull opened the connection to the prefill
            sources.spans.add("kv.handshake", started, started + result.connect_seconds)
        sources.spans.add("kv.transfer", started, time.monotonic(), result.num_bytes, len(remote))
        metrics.transfer_bytes.inc(result.num_bytes)
        metrics.transfer_seconds.inc(result.seconds)
        metrics.request_transfer_bytes.observe(result.num_bytes)
        metrics.request_transfer_seconds.observe(result.seconds)
        metrics.remote_kv_blocks.inc(len(remote))
        metrics.remote_kv_requests.inc()
        sources.kv_ready = time.monotonic()
        if handoff is not None:
            handoff.state = HandoffState.FETCHED
        self._release(request_id)
        self.finish(LoadResult(load.request_id, True))

    async def _load_embeddings(self, request_id: str, sources: PeerSources, load: KVLoad) -> None:
        embeddings = {}
        try:
            for mm_hash in load.mm_hashes:
                started = time.monotonic()
                address = sources.encoder_addrs[mm_hash]
                tensor = await self._intact("embeddings", request_id, lambda: self.client.fetch_embeddings(
                    address, mm_hash, timeout=self.transfer_timeout))
                embeddings[mm_hash] = tensor.to(self.dtype)
                sources.spans.add("embeddings.fetch", started, time.monotonic(), tensor.nbytes)
                self.metrics.embeddings_fetched.inc()
        except PULL_ERRORS as exc:
            logger.warning("request %s: image embeddings out of reach: %s", request_id, exc)
            self.metrics.embeddings_unavailable.inc()
            self.finish(LoadResult(load.request_id, False, failure_reason(exc)))
            return
        self.finish(LoadResult(load.request_id, True, mm_embeddings=embeddings))

    async def _intact(self, kind: str, request_id: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """`fetch()`, made once more if what landed was corrupted (counted by `kind`: kv | embeddings); a
        second IntegrityError is raised."""
        try:
            return await fetch()
        except IntegrityError as exc:
            self.metrics.integrity_failures[kind].inc()
            logger.warning("request %s: %s landed corrupted (%s); fetching again", request_id, kind, exc)
        try:
            return await fetch()
        except IntegrityError:
            self.metrics.integrity_failures[kind].inc()
            raise

    # -- prefill's hold (event loop) ----------------------------------------------------------------
    async def _hold(self, request_id: str, handoff: _Handoff) -> None:
        """Renew prefill's lease at half-time until the blocks are released; past the transfer timeout
        without room here, release them and let the request recompute."""
        handle = handoff.sources.kv_handle
        deadline = handle.lease_deadline  # on prefill's clock: the floor bounds the rate if ours is ahead
        give_up_at = handoff.arrival + self.transfer_timeout
        while True:
            await asyncio.sleep(max(min((deadline - time.time()) / 2, give_up_at - time.monotonic()), 0.25))
            if time.monotonic() >= give_up_at:
                logger.warning("request %s: no room for its KV here within %.0fs; recomputing the prompt here",
                               request_id, self.transfer_timeout)
                self._gave_up.add(request_id)
                handoff.sources.spans.add("decode.queue", handoff.arrival, time.monotonic())
                handoff.sources.failed = (time.monotonic(), "no_room")
                self._release(request_id)
                return
            try:
                renewed = await self.prefill_request(handle.control_addr, RenewLease(request_id), LeaseRenewed)
            except (ErrorReply, ChannelError, TimeoutError) as exc:  # the pull will fail and fall back
                logger.warning("request %s: lease renewal at %s failed: %s", request_id, handle.control_addr, exc)
                return
            deadline = renewed.lease_deadline
            self.metrics.lease_renewals.inc()

    def _release(self, request_id: str) -> None:
        """Tell prefill to free the blocks (once), without waiting for its answer."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or handoff.state is HandoffState.RELEASED:
            return
        handoff.state = HandoffState.RELEASED
        if handoff.renewal is not None and handoff.renewal is not asyncio.current_task():
            handoff.renewal.cancel()
        handle = handoff.sources.kv_handle
        if handle.control_addr:  # else only the lease frees them
            self._spawn(self._send_release(request_id, handle.control_addr))

    async def _send_release(self, request_id: str, control_addr: str) -> None:
        try:
            await self.prefill_request(control_addr, Release(request_id), Ack)
        except (ChannelError, TimeoutError) as exc:  # the lease frees the blocks anyway
            logger.warning("request %s: release at %s failed: %s", request_id, control_addr, exc)

    def _forget(self, request_id: str) -> None:
        self._release(request_id)
        self._handoffs.pop(request_id, None)
        self._gave_up.discard(request_id)

    async def prefill_request(self, control_addr: str, message: Message, expect: type) -> Message:
        """`message`'s answer from the prefill at `control_addr`, within the control channels' timeout; raises
        ChannelError or TimeoutError."""
        with self._prefills.holding(control_addr) as client:
            return await client.request(message, timeout=self._rpc_timeout, expect=expect)

    def _spawn(self, work: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def failure_reason(exc: BaseException) -> str:
    """Why a pull failed, as a span name's suffix: the error's kind (`blocks_not_found`: prefill released them
    or their lease ran out; `transfer_timeout`...)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower().removesuffix("_error")
