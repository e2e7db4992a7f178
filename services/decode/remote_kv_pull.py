"""`RemoteKVPull`: how one DecodeRequest gets its prompt's KV from the prefill engine that computed it.

    RESERVING --blocks reserved--> FETCHING --blocks pulled--> DECODING --> CLOSED
        |                              |
        +---- no room in time ---------+---- pull failed (prefill gone, lease expired) --> RECOMPUTING --> CLOSED

Prefill holds the blocks while the pull is RESERVING or FETCHING, and its lease is renewed meanwhile
(waiting for room here can take longer than a lease); leaving those states releases them. A failure
once the KV is in place (DECODING) is the request's failure, never a reason to recompute: tokens may
have gone out already.

A request with n > 1 is pulled once: its sequences fork from the one set of blocks, each continuing
from the first token prefill sampled for it.

Each handoff records its stages for the request's trace: `decode.queue` (arrival until blocks are
reserved), `kv.handshake` (within the pull, when it had to connect to the prefill first), `kv.transfer` (the
pull, with its bytes and blocks), `decode.first_step` (KV in place until the
first token decoded here); or, when the pull failed, `kv.recompute:<reason>` (the failure until the first
token decoded on the recomputed prompt).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import re
import time
from typing import TYPE_CHECKING, AsyncIterator

from epdserve.services.request_spans import RequestSpans
from epdserve.shared.engine.outputs import RequestOutput
from epdserve.transport.protocol import DecodeRequest, LeaseRenewed, RenewLease
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.scheduler import RemoteKVReservation
from epdserve.shared.engine.wire import sampling_params_from_wire
from epdserve.transport.kv_transfer import TransferError
from epdserve.transport.channel import ChannelError, ErrorReply

if TYPE_CHECKING:
    from epdserve.services.decode.worker import DecodeWorker

logger = logging.getLogger(__name__)

# What a pull from a peer fails with: the prompt is then recomputed here.
PULL_ERRORS = (TransferError, ChannelError, TimeoutError)


class PullState(enum.Enum):
    RESERVING = "reserving"  # waiting for room in this engine's pool
    FETCHING = "fetching"  # blocks reserved; the ones this engine lacks coming from prefill
    DECODING = "decoding"  # the prompt's KV in place: decoding from prefill's first token
    RECOMPUTING = "recomputing"  # the KV could not be had: the prompt is recomputed here
    CLOSED = "closed"  # the stream ended (finished, failed or abandoned)


_HOLDING = (PullState.RESERVING, PullState.FETCHING)  # prefill still holds the blocks for us


class RemoteKVPull:
    """Reserve blocks here, fetch the missing ones from prefill, release prefill, decode; or recompute the
    prompt here when the KV cannot be had. One per DecodeRequest; `state` is changed by this object only."""

    def __init__(self, worker: DecodeWorker, message: DecodeRequest, request: Request, spans: RequestSpans) -> None:
        self.worker = worker
        self.message = message
        self.request = request
        self.spans = spans
        self.state = PullState.RESERVING
        self._renewal: asyncio.Task | None = None
        self._kv_ready: float | None = None  # monotonic: when the prompt's KV was in place
        self._failed: tuple[float, str] | None = None  # monotonic time and reason of a failed pull
        # Prefill's first token of each sequence (n > 1: of each of the n).
        self.first_tokens = [message.first_token, *message.other_first_tokens]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs after prefill's first token, on the pulled KV or on the recomputed prompt."""
        if self.message.kv_handle.control_addr:
            self._renewal = asyncio.create_task(self._keep_lease())
        try:
            async for out in self._decode_pulled():
                yield out
            if self.state is PullState.RECOMPUTING:
                async for out in self._recompute():
                    yield out
        finally:
            self._enter(PullState.CLOSED)

    async def _decode_pulled(self) -> AsyncIterator[RequestOutput]:
        m, llm = self.message, self.worker.llm
        try:
            async for out in llm.generate_prefilled(self.request, self.first_tokens, self._fetch,
                                                    wait_timeout=self.worker.service.transport.transfer_timeout):
                if self._kv_ready is not None:
                    self.spans.add("decode.first_step", self._kv_ready, time.monotonic())
                    self._kv_ready = None
                yield out
        except PULL_ERRORS as exc:
            if self.state not in _HOLDING:
                raise
            reason = failure_reason(exc, self.state)
            logger.warning("request %s: KV pull from %s failed while %s (%s: %s); recomputing the prompt here",
                           m.request_id, m.kv_handle.kv_addr, self.state.value, reason, exc)
            now = time.monotonic()
            if self.state is PullState.RESERVING:  # it queued here until it gave up
                self.spans.add("decode.queue", self.request.arrival_time, now)
            self._failed = (now, reason)
            self._enter(PullState.RECOMPUTING)

    async def _fetch(self, reservation: RemoteKVReservation) -> None:
        """Pull the blocks this engine lacks into the reserved ones (the engine's `fill_kv`)."""
        self._enter(PullState.FETCHING)
        started = time.monotonic()
        self.spans.add("decode.queue", self.request.arrival_time, started)
        handle, metrics = self.message.kv_handle, self.worker.metrics
        remote = list(handle.block_ids[reservation.first_remote_block:])
        metrics.local_kv_hit_blocks.inc(reservation.first_remote_block)
        if remote:
            try:
                result = await self.worker.kv_client.fetch_blocks(
                    handle.kv_addr, self.message.request_id, remote, reservation.block_ids,
                    timeout=self.worker.service.transport.transfer_timeout)
            except PULL_ERRORS:
                metrics.transfer_failures.inc()
                self.spans.add("kv.transfer:failed", started, time.monotonic(), 0, len(remote))
                raise
            if result.connect_seconds:  # this pull opened the connection to the prefill
                self.spans.add("kv.handshake", started, started + result.connect_seconds)
            self.spans.add("kv.transfer", started, time.monotonic(), result.num_bytes, len(remote))
            metrics.transfer_bytes.inc(result.num_bytes)
            metrics.transfer_seconds.inc(result.seconds)
            metrics.request_transfer_bytes.observe(result.num_bytes)
            metrics.request_transfer_seconds.observe(result.seconds)
            metrics.remote_kv_blocks.inc(len(remote))
        self._kv_ready = time.monotonic()
        self._enter(PullState.DECODING)
        metrics.remote_kv_requests.inc()

    async def _recompute(self) -> AsyncIterator[RequestOutput]:
        """Recompute the prompt and prefill's first token here and go on from there: the same tokens the
        pulled KV would have given (penalties, limits and seeded noise included)."""
        m, llm = self.message, self.worker.llm
        self.worker.metrics.local_prefills.inc()
        fallback = await llm.make_request(
            {"prompt_token_ids": list(m.prompt_token_ids)}, sampling_params_from_wire(m.sampling_params),
            m.request_id,
            cache_salt=m.cache_salt, mm_placeholders=self.request.mm_placeholders,
            mm_embeddings=self.request.mm_embeddings)
        failed, reason = self._failed or (time.monotonic(), "unknown")
        first = True
        async for out in llm.generate_recomputed(fallback, self.first_tokens):
            if first:
                self.spans.add(f"kv.recompute:{reason}", failed, time.monotonic())
                first = False
            yield out

    def _enter(self, state: PullState) -> None:
        if self.state in _HOLDING and state not in _HOLDING:
            self._release()
        self.state = state

    def _release(self) -> None:
        """Tell prefill to free the blocks, in the background: decoding need not wait for its answer."""
        if self._renewal is not None:
            self._renewal.cancel()
        if self.message.kv_handle.control_addr:  # else only the lease frees them
            self.worker.release_soon(self.message.kv_handle.control_addr, self.message.request_id)

    async def _keep_lease(self) -> None:
        """Renew the prefill's lease at half-time until the blocks are released."""
        handle = self.message.kv_handle
        deadline = handle.lease_deadline  # on prefill's clock: the floor bounds the rate if ours is ahead
        while True:
            await asyncio.sleep(max((deadline - time.time()) / 2, 0.25))
            try:
                renewed = await self.worker.prefill_request(handle.control_addr, RenewLease(self.message.request_id),
                                                            LeaseRenewed)
            except (ErrorReply, ChannelError, TimeoutError) as exc:  # the pull will fail and fall back
                logger.warning("request %s: lease renewal at %s failed: %s", self.message.request_id,
                               handle.control_addr, exc)
                return
            deadline = renewed.lease_deadline
            self.worker.metrics.lease_renewals.inc()


def failure_reason(exc: BaseException, state: PullState) -> str:
    """Why a pull failed, as a span name's suffix: `no_room` (no blocks free here in time), else the
    error's kind (`blocks_not_found`: prefill released them or their lease ran out; `transfer_timeout`...)."""
    if state is PullState.RESERVING:
        return "no_room"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower().removesuffix("_error")
