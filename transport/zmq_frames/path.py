"""Blocks and embeddings as zero-copy ZMQ frames on the control channel itself: the ZMQ transport's path where
its block connections cannot serve - the channel is encrypted (CURVE covers ZMQ connections only), or a
cache lives on a device - and its only path for embeddings.

The server answers FetchBlocks with BlocksData whose frames are sent from the cache's memory, with the
checksum of each; it keeps their trackers, so that the blocks are not freed while ZMQ's I/O thread still
reads them (`sending`). The fetch is checked and its reply's tracked send begins on the event loop with no
await in between (a ROUTER socket sends without waiting), so a withdraw, on the same loop, finds either a
refused fetch or a tracker. A device cache's segments are staged in one pinned host buffer first. The
client receives into memory libzmq allocates and copies once into the cache - ZMQ has no receive into
caller memory and hands a multipart message over only whole - then checks the segments where they landed
(gathered blocks, and the blocks of a device cache: in the received frames, before they are scattered or
copied to the device). Copies out of ZMQ frames run on the event loop thread: handing them to a worker
thread cost more in wake-ups than it saved (measured on two cores: up to 1.5x slower).

Embeddings go the same way, as EmbeddingsData with the tensor's checksum.
"""
from __future__ import annotations

import torch
import zmq

from epdserve.transport.channel.protocol import (BlocksData, EmbeddingsData, FetchBlocks, FetchEmbeddings,
                                                 Handshake, HandshakeAck, Message)
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.kv import checksum
from epdserve.transport.kv.base import Chunk, ClientPath, ServerPath
from epdserve.transport.kv.transfer import BlockRangeError, TransferError, as_bytes, copy_segment, run_segments


class FrameServerPath(ServerPath):
    transport = "zmq"

    def __init__(self) -> None:
        # request id -> trackers of replies whose frames ZMQ may still be reading from the cache.
        self._unsent: dict[str, list[zmq.MessageTracker]] = {}

    def serves(self, message: FetchBlocks | FetchEmbeddings) -> bool:
        return message.ucx_tag is None

    async def reply_blocks(self, message: FetchBlocks, peer: Handshake) -> tuple[Message, int]:
        segments = _host_segments(self.server.segments(message))
        sums = checksum.checksums(as_bytes(segment) for segment in segments)
        return BlocksData(message.request_id, message.block_ids, sums, tuple(segments)), \
            sum(segment.nbytes for segment in segments)

    async def reply_embeddings(self, message: FetchEmbeddings, peer: Handshake, tensor: torch.Tensor) -> Message:
        data = tensor.detach().contiguous().cpu()  # a GPU encoder cache sends host bytes
        return EmbeddingsData(message.mm_hash, checksum.checksum(as_bytes(data)), data)

    def on_sent(self, reply: Message, tracker: zmq.MessageTracker) -> None:
        if isinstance(reply, BlocksData) and not tracker.done:
            trackers = self._unsent.setdefault(reply.request_id, [])
            trackers[:] = [t for t in trackers if not t.done]
            trackers.append(tracker)

    def sending(self, request_id: str) -> bool:
        trackers = self._unsent.get(request_id)
        if trackers and any(not t.done for t in trackers):
            return True
        self._unsent.pop(request_id, None)
        return False


def _host_segments(segments: list[torch.Tensor]) -> list[torch.Tensor]:
    """Segments in host memory, for a socket to send: device segments are copied into one pinned staging
    buffer (torch's pinned-memory cache hands the same memory back to the next message)."""
    if not segments or segments[0].device.type == "cpu":
        return segments
    staging = torch.empty(sum(s.numel() for s in segments), dtype=segments[0].dtype, pin_memory=True)
    views, offset = [], 0
    for segment in segments:
        view = staging[offset:offset + segment.numel()].view(segment.shape)
        view.copy_(segment, non_blocking=True)
        views.append(view)
        offset += segment.numel()
    torch.cuda.current_stream(segments[0].device).synchronize()
    return views


class FrameClientPath(ClientPath):
    transport = "zmq"
    fetches_embeddings = True

    def usable(self, peer: HandshakeAck) -> bool:
        return True  # every ZMQ server answers over its channel

    async def fetch_chunk(self, control: RequestClient, request: FetchBlocks, chunk: Chunk, deadline: float) -> int:
        client = self.client
        reply = await control.request(request, timeout=client.remaining(deadline), expect=BlocksData)
        if reply.block_ids != request.block_ids:
            raise TransferError(f"{control.address} answered with blocks {reply.block_ids[:8]}..., not those asked for")
        destinations = None if chunk.gathered else run_segments(client.kv_cache, chunk.local_runs)
        shapes = [client.gathered_shape(chunk)] if chunk.gathered else [d.shape for d in destinations]
        if len(reply.segments) != len(shapes):
            raise BlockRangeError(f"peer sent {len(reply.segments)} segments, expected {len(shapes)}")
        for segment, shape in zip(reply.segments, shapes):
            if segment.dtype != client.kv_cache.dtype or segment.shape != shape:
                raise BlockRangeError(f"peer sent {segment.dtype}{list(segment.shape)}, expected "
                                      f"{client.kv_cache.dtype}{list(shape)}")
        if chunk.gathered:
            return client.land(chunk, [as_bytes(reply.segments[0])], reply.checksums, gathered=reply.segments[0],
                               source=control.address)
        on_device = client.kv_cache.device.type != "cpu"
        if on_device:  # checked in the host memory they arrived in: hashing device blocks would copy them back
            num_bytes = client.land(chunk, [as_bytes(s) for s in reply.segments], reply.checksums,
                                    source=control.address)
        landed = []
        for segment, destination in zip(reply.segments, destinations):
            if on_device:
                copy_segment(destination, segment)
            else:  # each piece hashed as soon as it is in the cache, while the CPU's caches hold it
                landed.append(checksum.copy_hashed(as_bytes(destination), as_bytes(segment)))
        if on_device:
            return num_bytes
        return client.land(chunk, [as_bytes(d) for d in destinations], reply.checksums, landed=landed,
                           source=control.address)

    async def fetch_embeddings(self, control: RequestClient, mm_hash: str,
                               deadline: float) -> tuple[torch.Tensor, int]:
        reply = await control.request(FetchEmbeddings(mm_hash), timeout=self.client.remaining(deadline),
                                      expect=EmbeddingsData)
        if reply.mm_hash != mm_hash:
            raise TransferError(f"{control.address} answered with embeddings of {reply.mm_hash!r}")
        return reply.data, reply.checksum
