"""The UCX transport's data path (ucxx): block and embedding bytes go as UCX tagged messages; the handshake,
fetch requests and errors go over the KV transfer server's typed ZMQ control channel, as for every path.

No UCX listener is opened (ucxx's would bind every interface): each side sends its UCX worker
address in the ZMQ handshake (bound, and authenticated by the deployment's secret or CURVE, like any other
channel), the server connects an endpoint to the client's to send, and the client one to the server's, through
which it posts its receives (so that closing it cancels them); endpoints are kept per peer worker and
aborted once unused for a while (`Endpoints`, endpoints.py). UCX parses worker addresses from peers: a server reads a
client's only once its hello proved the secret (`check_peer` runs after that check), and a client the
server's only once the HandshakeAck proved it back.

One fetch message: the client posts one receive per segment (run x layer x K/V) straight into the
destination blocks of its cache (blocks that form no runs: into one buffer, scattered after), with
tags ucx_tag .. ucx_tag + n - 1, then sends FetchBlocks; the server takes each segment's checksum,
starts one send per segment from its own cache and answers BlocksSent, with the checksums, at once. The
receives are posted before the data leaves, so UCX delivers into the cache without holding an unexpected
copy; on the server nothing is gathered. Once every receive completed, the client compares the
checksums of what landed with those of BlocksSent (KVTransferClient.land). A receive that fails or
times out aborts the endpoint, which cancels every receive still posted on it: no late data lands in
blocks the caller reuses. Embeddings go the same way (EmbeddingsSent carries their checksum).

A fetch counts as sending from its check on (`sending`), before it waits for an endpoint or a send slot:
a withdraw in that wait does not free the blocks under the send that follows. `ucxx` is an optional
extra, imported on first use (endpoints.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from epdserve.transport.channel import peer_pool
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.protocol import (BlocksSent, EmbeddingsSent, Error, ErrorCode, FetchBlocks,
                                                 FetchEmbeddings, Handshake, HandshakeAck, Message)
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.channel.tensor_frames import check_spec, tensor_spec
from epdserve.transport.kv import checksum
from epdserve.transport.kv.base import Chunk, ClientPath, ServerPath
from epdserve.transport.kv.transfer import BlockRangeError, TransferError, TransferTimeout, as_bytes
from epdserve.transport.ucx.endpoints import Endpoints, PeerLost, completed, import_ucxx, init_ucx, post

logger = logging.getLogger(__name__)

MAX_WORKER_ADDRESS_BYTES = 64 << 10
# A message's segments take consecutive tags from its ucx_tag: the client draws ucx_tag with these
# low bits clear, so that no two messages' tags meet.
SEGMENT_TAG_BITS = 24


class UcxServerPath(ServerPath):
    """A KV transfer server's UCX path: sends each fetched segment from the cache as a tagged message to the
    client's worker, which posted its receives first.

    `net_devices` limits the interfaces UCX uses (UCX's NET_DEVICES; None or "all": every one, which
    reaches other hosts); e.g. "eth0" or "mlx5_0:1" keeps it on one fabric. `ucx_options` (UCX
    settings without the UCX_ prefix) replace endpoints.DEFAULT_OPTIONS.
    """

    transport = "ucx"

    def __init__(self, net_devices: str | None = None, ucx_options: Mapping[str, str] | None = None,
                 max_inflight_sends: int = 8, send_timeout: float = 30.0,
                 peer_idle_seconds: float = peer_pool.IDLE_SECONDS) -> None:
        self._net_devices, self._ucx_options = net_devices, ucx_options
        self._ucxx = import_ucxx()
        self._endpoints = Endpoints(lambda: self._ucxx, peer_idle_seconds)  # by client worker address
        self._sends: set[asyncio.Task] = set()
        self._sends_of: dict[str, set[asyncio.Task]] = {}  # request id -> its block sends in flight
        # request id -> fetches of it checked and not yet handed to a send task (waiting for an endpoint or slot)
        self._starting: collections.Counter[str] = collections.Counter()
        self._send_slots: asyncio.Semaphore | None = None
        self._max_inflight_sends = max_inflight_sends
        self._send_timeout = send_timeout

    async def start(self) -> None:
        self._ucxx = init_ucx(self._net_devices, self._ucx_options)
        self.server.control.ucx_address = bytes(self._ucxx.get_worker_address())
        self._send_slots = asyncio.Semaphore(self._max_inflight_sends)

    def serves(self, message: FetchBlocks | FetchEmbeddings) -> bool:
        return message.ucx_tag is not None

    async def check_peer(self, hello: Handshake) -> str | None:
        if hello.ucx_address is None:
            return None
        if len(hello.ucx_address) > MAX_WORKER_ADDRESS_BYTES:
            return "UCX worker address too long"
        try:  # made now, so that a client we cannot reach is refused at once
            self._endpoints.release(hello.ucx_address, await self._endpoints.acquire(hello.ucx_address))
        except TransferError as e:
            return str(e)
        return None

    async def reply_blocks(self, message: FetchBlocks, peer: Handshake) -> tuple[Message, int]:
        rid = message.request_id
        self._starting[rid] += 1  # before the check: reading the blocks from here on
        try:
            buffers = self.server.segment_bytes(message)
            if len(buffers) >= 1 << SEGMENT_TAG_BITS or message.ucx_tag + len(buffers) >= 1 << 64:
                raise ErrorReply(Error(ErrorCode.OUT_OF_RANGE, "too many segments for the tag range", rid))
            sums = checksum.checksums(buffers)
            await self._send_later(peer, buffers, message.ucx_tag, rid)
        finally:
            self._starting[rid] -= 1
            if not self._starting[rid]:
                del self._starting[rid]
        return BlocksSent(rid, len(buffers), sums), sum(b.nbytes for b in buffers)

    async def reply_embeddings(self, message: FetchEmbeddings, peer: Handshake, tensor: torch.Tensor) -> Message:
        tensor = tensor.detach().contiguous().cpu()
        sent = checksum.checksum(as_bytes(tensor))
        await self._send_later(peer, [as_bytes(tensor)], message.ucx_tag, None)
        return EmbeddingsSent(message.mm_hash, tensor_spec(tensor), sent)

    async def _send_later(self, peer: Handshake, buffers: list, tag: int, request_id: str | None) -> None:
        """Start sending buffer i with tag + i (from its own memory); the sends complete on their own."""
        if not peer.ucx_address:
            raise ErrorReply(Error(ErrorCode.INCOMPATIBLE, "no UCX endpoint to this client (handshake without a "
                                                           "UCX address)", request_id))
        try:
            endpoint = await self._endpoints.acquire(peer.ucx_address)
        except TransferError as e:
            raise ErrorReply(Error(ErrorCode.INCOMPATIBLE, str(e), request_id)) from None
        try:
            await self._send_slots.acquire()  # bounds the messages waiting for their receivers
        except BaseException:
            self._endpoints.release(peer.ucx_address, endpoint)
            raise
        task = asyncio.create_task(self._send(endpoint, buffers, tag, peer))
        self._sends.add(task)
        if request_id is not None:
            self._sends_of.setdefault(request_id, set()).add(task)
        task.add_done_callback(lambda t: self._sent(t, request_id))

    def _sent(self, task: asyncio.Task, request_id: str | None) -> None:
        self._sends.discard(task)
        self._send_slots.release()
        sends = self._sends_of.get(request_id)
        if sends is not None:
            sends.discard(task)
            if not sends:
                del self._sends_of[request_id]

    async def _send(self, endpoint: Any, buffers: list, tag: int, peer: Handshake) -> None:
        try:
            await completed(post(endpoint, buffers, tag, send=True), self._send_timeout)
        except BaseException as e:  # the client died or gave up, or the send was cut: its fetch fails
            if not isinstance(e, asyncio.CancelledError):
                logger.warning("%s: UCX send to %s failed: %s", self.server.engine_id, peer.engine_id,
                               e or type(e).__name__)
            self._endpoints.abort(peer.ucx_address, endpoint)  # cancels the sends still reading the cache
            if not isinstance(e, Exception):
                raise
        finally:
            self._endpoints.release(peer.ucx_address, endpoint)

    def sending(self, request_id: str) -> bool:
        return bool(self._sends_of.get(request_id)) or request_id in self._starting

    def abort(self, request_id: str) -> None:
        for task in list(self._sends_of.get(request_id, ())):
            task.cancel()

    async def close(self) -> None:
        for task in list(self._sends):
            task.cancel()
        await self._endpoints.close()


class UcxClientPath(ClientPath):
    """A KV transfer client's UCX path; see UcxServerPath for `net_devices` and the message flow."""

    transport = "ucx"
    fetches_embeddings = True

    def __init__(self, net_devices: str | None = None, ucx_options: Mapping[str, str] | None = None) -> None:
        self._net_devices, self._ucx_options = net_devices, ucx_options
        self._ucxx = import_ucxx()

    def bind(self, client) -> None:
        super().bind(client)
        # by server worker address: this worker's endpoints to the servers', through which receives are posted
        self._endpoints = Endpoints(lambda: init_ucx(self._net_devices, self._ucx_options), client.peer_idle_seconds)

    def hello_extra(self) -> dict:
        self._ucxx = init_ucx(self._net_devices, self._ucx_options)
        return {"ucx_address": bytes(self._ucxx.get_worker_address())}

    def usable(self, peer: HandshakeAck) -> bool:
        return True  # a UCX server (the handshake checked the transport)

    async def fetch_chunk(self, control: RequestClient, request: FetchBlocks, chunk: Chunk, deadline: float) -> int:
        buffers, gathered = self.client.landing(chunk)
        tag = secrets.randbits(64 - SEGMENT_TAG_BITS) << SEGMENT_TAG_BITS
        # Posted before the request leaves: the data lands in the blocks, never in UCX's unexpected queue.
        reply = await self._receive(control, buffers, tag, deadline, dataclasses.replace(request, ucx_tag=tag))
        return self.client.land(chunk, buffers, reply.checksums, gathered=gathered, source=control.address)

    async def _cancel(self, ucx_address: bytes, endpoint: Any, receives: list[Any]) -> None:
        """Abort the endpoint: UCX cancels the receives still posted on it, so that no late data
        lands in cache blocks the caller is about to reuse. Fetches sharing it fail too (and retry
        on a fresh endpoint): a server that misses a deadline is rarely healthy for the others."""
        self._endpoints.abort(ucx_address, endpoint)
        try:
            await completed(receives, 1.0)
        except asyncio.TimeoutError:
            logger.error("%s: UCX receives into the KV cache outlived their endpoint", self.client.engine_id)
        except Exception:
            pass  # cancelled by the abort, as intended

    async def fetch_embeddings(self, control: RequestClient, mm_hash: str,
                               deadline: float) -> tuple[torch.Tensor, int]:
        tag = secrets.randbits(64)
        reply = await control.request(FetchEmbeddings(mm_hash, ucx_tag=tag), timeout=self.client.remaining(deadline),
                                      expect=EmbeddingsSent)
        if reply.mm_hash != mm_hash:
            raise ErrorReply(Error(ErrorCode.BAD_REQUEST, f"answered with embeddings of {reply.mm_hash!r}"))
        dtype, _ = check_spec(reply.spec, self.client.limits)
        data = torch.empty(reply.spec.shape, dtype=dtype)
        await self._receive(control, [as_bytes(data)], tag, deadline)
        return data, reply.checksum

    async def _receive(self, control: RequestClient, buffers: list, tag: int, deadline: float,
                       request: FetchBlocks | None = None) -> BlocksSent | None:
        """Post a receive per buffer (tags tag, tag + 1, ...), send `request` if any, and wait for the data;
        the request's answer. On any failure abort the endpoint (see _cancel)."""
        address, ucx_address = control.address, control.peer.ucx_address
        if not ucx_address or len(ucx_address) > MAX_WORKER_ADDRESS_BYTES:
            raise TransferError(f"{address} sent no usable UCX worker address")
        endpoint = await self._endpoints.acquire(ucx_address)
        disconnects, receives, reply = control.num_disconnects, [], None
        remaining = self.client.remaining
        try:
            receives = post(endpoint, buffers, tag, send=False)
            if request is not None:
                reply = await control.request(request, timeout=remaining(deadline), expect=BlocksSent)
                if reply.num_segments != len(buffers):
                    raise BlockRangeError(f"peer sends {reply.num_segments} segments, expected {len(buffers)}")
            try:
                # Over shared memory UCX never notices a dead sender: its control connection does.
                await completed(receives, remaining(deadline), peer_lost=lambda: control.num_disconnects != disconnects)
            except asyncio.TimeoutError:
                raise TransferTimeout(f"{address}: UCX data did not arrive in time") from None
            except PeerLost:
                raise TransferError(f"{address}: the control connection dropped with UCX data in flight") from None
            except Exception as e:  # UCX's own exception types (truncated message, endpoint error)
                raise TransferError(f"{address}: UCX receive failed: {e}") from e
        except BaseException:
            await self._cancel(ucx_address, endpoint, receives)
            raise
        finally:
            self._endpoints.release(ucx_address, endpoint)
        return reply

    async def close(self) -> None:
        await self._endpoints.close()
