"""The decode service: continues requests whose prompt a prefill service computed.

A DecodeRequest becomes an engine request that continues from the first token(s) prefill sampled
(`peer_token_ids`) and names, as its `kv_transfer_params`, the prefill holding its prompt's KV. The engine
reserves blocks for the prompt when it has room (reusing its own prefix-cache hits) and its KV connector
(`PeerKVConnector`) pulls the missing ones, releases prefill, and lets the request decode - or, if the pull
fails or no room turns up in time, the engine recomputes the prompt itself rather than fail the request.
It also prefills locally when the proxy asks (GenerateRequest): short prompts, no healthy prefill, or a
stream another decode lost, continued here from the tokens it had delivered (`output_token_ids`).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from epdserve.services.host.engine_worker import EngineWorker, bad_request, kv_transfer_client, start_engine
from epdserve.services.host.peer_kv_connector import PeerSources
from epdserve.services.host.request_spans import RequestSpans
from epdserve.shared.config import EngineConfig, ServiceConfig
from epdserve.shared.engine import RequestOutput
from epdserve.transport.channel.protocol import DecodeRequest, Error, Handshake, Message, Role

if TYPE_CHECKING:
    from epdserve.shared.engine import Request

logger = logging.getLogger(__name__)


async def build_decode_worker(service: ServiceConfig, engine_config: EngineConfig, control_rejected: Callable[[], int],
                              on_dead: Callable[[BaseException], None]) -> DecodeWorker:
    llm = await start_engine(service, engine_config, on_dead)
    return DecodeWorker(service, engine_config, llm, kv_transfer_client(service, engine_config, llm), control_rejected)


class DecodeWorker(EngineWorker):
    role = Role.DECODE

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, DecodeRequest):
            return await self._start_decode(message)
        return await super().handle(message, peer)

    async def _start_decode(self, message: DecodeRequest) -> Message:
        if not message.prompt_token_ids or message.kv_handle.num_tokens != len(message.prompt_token_ids):
            return bad_request(message.request_id, "the KV handle does not cover the prompt")
        if len(message.other_first_tokens) != message.sampling_params.n - 1:
            return bad_request(message.request_id, "a decode request needs one first token per sequence (n)")
        spans = RequestSpans(self.service.engine_id)
        made = await self.make_request(message, spans, kv_handle=message.kv_handle,
                                       peer_token_ids=[(message.first_token,), *((t,) for t in message.other_first_tokens)])
        if isinstance(made, Error):
            return made
        request, sources = made
        self.llm.expect(message.request_id, sources)  # the peers' connector holds prefill's blocks until it pulls them
        return self.spawn_stream(request, lambda: self._decoded(request, sources), message.reply_to, spans)

    async def _decoded(self, request: Request, sources: PeerSources) -> AsyncIterator[RequestOutput]:
        """The request's outputs after prefill's first tokens; its first one records how the KV came:
        `decode.first_step` (KV in place until the first token decoded here), or `kv.recompute:<reason>`
        (the failure until the first token decoded on the recomputed prompt)."""
        outputs = self.llm.generate(request)
        try:
            first = True
            async for out in outputs:
                if first:
                    first = False
                    if sources.kv_ready is not None:
                        sources.spans.add("decode.first_step", sources.kv_ready, time.monotonic())
                    elif sources.failed is not None:
                        self.metrics.local_prefills.inc()
                        failed_at, reason = sources.failed
                        sources.spans.add(f"kv.recompute:{reason}", failed_at, time.monotonic())
                yield out
        finally:
            await outputs.aclose()  # aborts the request in the engine if it did not finish
