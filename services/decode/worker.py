"""The decode service: continues requests whose prompt a prefill service computed.

For a DecodeRequest it reserves blocks for the whole prompt (reusing its own prefix-cache hits), pulls
only the blocks it lacks from the prefill engine named in the request's KV handle, tells that engine to
release them, and joins the request to its continuous batch from the first token prefill sampled. While
the request waits here for room it renews the prefill's lease on those blocks. If the pull fails
(prefill gone, lease expired) it recomputes the prompt itself rather than fail the request: each such
handoff is a `RemoteKVPull` (remote_kv_pull.py), a small state machine.
It also prefills locally when the proxy asks (GenerateRequest): short prompts, or no healthy prefill.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from epdserve.services.decode.remote_kv_pull import RemoteKVPull
from epdserve.services.engine_worker import (EngineWorker, bad_request, control_client_kwargs, kv_transfer_client,
                                             start_engine)
from epdserve.services.request_spans import RequestSpans
from epdserve.shared.config import EngineConfig, ServiceConfig
from epdserve.transport.channel import ChannelError
from epdserve.transport.peer_pool import PeerPool
from epdserve.transport.protocol import Ack, DecodeRequest, Error, Handshake, Message, Release, Role
from epdserve.transport.request_client import RequestClient

logger = logging.getLogger(__name__)


async def build_decode_worker(service: ServiceConfig, engine_config: EngineConfig, control_rejected: Callable[[], int],
                              on_dead: Callable[[BaseException], None]) -> DecodeWorker:
    llm = await start_engine(service, engine_config, on_dead)
    return DecodeWorker(service, engine_config, llm, kv_transfer_client(service, engine_config, llm), control_rejected)


class DecodeWorker(EngineWorker):
    """Also owns its clients to prefills' control channels, one per prefill, opened on first use and
    closed once unused (prefills come and go)."""

    role = Role.DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prefill_clients: PeerPool[str, RequestClient] = PeerPool(  # control address -> client
            lambda address: RequestClient(address, **control_client_kwargs(self.service)), RequestClient.close)
        self._releases: set[asyncio.Task] = set()

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, DecodeRequest):
            return await self._start_decode(message)
        return await super().handle(message, peer)

    async def _start_decode(self, m: DecodeRequest) -> Message:
        if not m.prompt_token_ids or m.kv_handle.num_tokens != len(m.prompt_token_ids):
            return bad_request(m.request_id, "the KV handle does not cover the prompt")
        if len(m.other_first_tokens) != m.sampling_params.n - 1:
            return bad_request(m.request_id, "a decode request needs one first token per sequence (n)")
        spans = RequestSpans(self.service.engine_id)
        request = await self.make_request(m, spans)
        if isinstance(request, Error):
            return request
        return self.spawn_stream(request, RemoteKVPull(self, m, request, spans).outputs, m.reply_to, spans)

    async def prefill_request(self, control_addr: str, message: Message, expect: type) -> Message:
        """`message`'s answer from the prefill at `control_addr` (RequestClient.request, within the
        control channels' timeout); raises ChannelError or TimeoutError."""
        with self._prefill_clients.holding(control_addr) as client:
            return await client.request(message, timeout=self.service.transport.rpc_timeout, expect=expect)

    def release_soon(self, control_addr: str, request_id: str) -> None:
        """Tell the prefill at `control_addr` to free the request's blocks, without waiting for its answer."""
        task = asyncio.create_task(self._release(control_addr, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, control_addr: str, request_id: str) -> None:
        try:
            await self.prefill_request(control_addr, Release(request_id), Ack)
        except (ChannelError, TimeoutError) as exc:  # the lease frees the blocks anyway
            logger.warning("request %s: release at %s failed: %s", request_id, control_addr, exc)

    async def close(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)
        await super().close()
        await self._prefill_clients.close()
