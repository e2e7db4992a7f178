"""The decode service: continues requests whose prompt a prefill service computed.

For a DecodeRequest it reserves blocks for the whole prompt (reusing its own prefix-cache hits), pulls
only the blocks it lacks from the prefill engine named in the request's KV handle, tells that engine to
release them, and joins the request to its continuous batch from the first token prefill sampled. While
the request waits here for room it renews the prefill's lease on those blocks. If the pull fails
(prefill gone, lease expired) it recomputes the prompt itself rather than fail the request.
It also prefills locally when the proxy asks (GenerateRequest): short prompts, or no healthy prefill.
"""
from __future__ import annotations

import asyncio
import logging
import time

from epdserve.services.engine_worker import EngineWorker, bad_request
from epdserve.shared.protocol import (
    Ack, DecodeRequest, Error, Handshake, KVHandle, LeaseRenewed, Message, Release, RenewLease, Role,
)
from epdserve.shared.scheduler import RemoteKVReservation
from epdserve.transport.kv_transfer import TransferError
from epdserve.transport.queues import ChannelError, ErrorReply, RequestClient

logger = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = Role.DECODE

    def __init__(self, *args, make_client, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_client = make_client  # address -> RequestClient to a prefill's control channel
        self._prefill_clients: dict[str, RequestClient] = {}
        self._releases: set[asyncio.Task] = set()

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, DecodeRequest):
            return await self._start_decode(message)
        return await super().handle(message, peer)

    async def _start_decode(self, m: DecodeRequest) -> Message:
        if not m.prompt_token_ids or m.kv_handle.num_tokens != len(m.prompt_token_ids):
            return bad_request(m.request_id, "the KV handle does not cover the prompt")
        request = await self.make_request(m)
        if isinstance(request, Error):
            return request
        handle = m.kv_handle
        released = False
        renewing: asyncio.Task | None = None

        def release() -> None:
            """Tell prefill to free the blocks, in the background: decoding need not wait for its answer."""
            nonlocal released
            if not released:
                released = True
                if renewing is not None:
                    renewing.cancel()
                task = asyncio.create_task(self._release(handle.control_addr, m.request_id))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

        async def fill(reservation: RemoteKVReservation) -> None:
            remote = list(handle.block_ids[reservation.first_remote_block:])
            self.metrics.local_kv_hit_blocks.inc(reservation.first_remote_block)
            try:
                if remote:
                    result = await self.kv_client.fetch_blocks(handle.kv_addr, m.request_id, remote,
                                                               reservation.block_ids,
                                                               timeout=self.service.transport.transfer_timeout)
                    self.metrics.transfer_bytes.inc(result.num_bytes)
                    self.metrics.transfer_seconds.inc(result.seconds)
                    self.metrics.remote_kv_blocks.inc(len(remote))
            except (TransferError, ChannelError, TimeoutError):
                self.metrics.transfer_failures.inc()
                raise
            finally:
                release()
            self.metrics.remote_kv_requests.inc()

        async def outputs():
            nonlocal renewing
            if handle.control_addr:
                renewing = asyncio.create_task(self._keep_lease(handle, m.request_id))
            try:
                async for out in self.llm.generate_prefilled(request, m.first_token, fill,
                                                             wait_timeout=self.service.transport.transfer_timeout):
                    yield out
                return
            except (TransferError, ChannelError, TimeoutError) as exc:
                logger.warning("request %s: KV pull from %s failed (%s); recomputing the prompt here",
                               m.request_id, handle.kv_addr, exc)
            finally:
                release()
            # Recompute the prompt and prefill's first token here and go on from there: the same tokens
            # the pulled KV would have given (penalties, limits and seeded noise included).
            self.metrics.local_prefills.inc()
            fallback = self.llm.make_request(
                {"prompt_token_ids": list(m.prompt_token_ids)}, request.sampling_params, m.request_id,
                cache_salt=m.cache_salt, mm_placeholders=request.mm_placeholders, mm_embeddings=request.mm_embeddings)
            async for out in self.llm.generate_recomputed(fallback, m.first_token):
                yield out

        return self.spawn_stream(request, outputs, m.reply_to)

    def _prefill_client(self, control_addr: str) -> RequestClient:
        client = self._prefill_clients.get(control_addr)
        if client is None:
            client = self._prefill_clients[control_addr] = self._make_client(control_addr)
        return client

    async def _keep_lease(self, handle: KVHandle, request_id: str) -> None:
        """Renew the prefill's lease at half-time until the blocks are released (waiting for room here
        can take longer than a lease)."""
        deadline = handle.lease_deadline  # on prefill's clock: the floor bounds the rate if ours is ahead
        while True:
            await asyncio.sleep(max((deadline - time.time()) / 2, 0.25))
            try:
                renewed = await self._prefill_client(handle.control_addr).request(
                    RenewLease(request_id), timeout=self.service.transport.request_timeout, expect=LeaseRenewed)
            except (ErrorReply, ChannelError, TimeoutError) as exc:  # the pull will fail and fall back
                logger.warning("request %s: lease renewal at %s failed: %s", request_id, handle.control_addr, exc)
                return
            deadline = renewed.lease_deadline
            self.metrics.lease_renewals.inc()

    async def _release(self, control_addr: str, request_id: str) -> None:
        try:
            await self._prefill_client(control_addr).request(
                Release(request_id), timeout=self.service.transport.request_timeout, expect=Ack)
        except (ChannelError, TimeoutError) as exc:  # the lease frees the blocks anyway
            logger.warning("request %s: release at %s failed: %s", request_id, control_addr, exc)

    async def close(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)
        await super().close()
        for client in self._prefill_clients.values():
            await client.close()
