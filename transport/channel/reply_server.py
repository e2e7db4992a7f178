"""The binding end of typed channels: ReplyServer (ROUTER: handshakes, then a handler per message and
its reply) and PullChannel (the receiving end of push channels, in arrival order). See common.py for
the framing and the handshake."""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio

from epdserve.transport.channel import codec, security
from epdserve.transport.channel.common import (
    NO_REPLY, ChannelTimeout, ErrorReply, Handler, HandshakeCheck, Rejections, configure_socket, rejection_reason,
)
from epdserve.transport.channel.codec import DEFAULT_LIMITS, DecodeError, Limits, VersionMismatchError
from epdserve.transport.channel.protocol import (
    PROTOCOL_VERSION, Error, ErrorCode, Handshake, HandshakeAck, KVLayout, Message, Role,
)
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.security import CurveConfig

logger = logging.getLogger(__name__)


class ReplyServer:
    """ROUTER side: accepts handshakes, then passes each message to a handler and sends its reply.

    Handlers run concurrently (at most `max_inflight` at once; beyond that the socket is not read,
    which pushes back on senders). With `ordered=True` each message is handled to completion before
    the next is read, which keeps a stream's order. With `senders`, a message its peer's role may not
    send is refused (an Error reply) and counted as rejected. With `on_sent`, a reply carrying tensors
    is sent tracked and the tracker handed to it: ZMQ sends tensor frames from the tensors' own memory
    on its IO thread, so whoever owns that memory must not reuse it before the tracker is done.
    `ack_extra` gives further HandshakeAck fields for an accepted peer. With `auth`, a peer's hello must
    prove the deployment's secret (peer_auth.py); one that does not is refused and counted in
    `num_auth_denied`.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_wildcard: bool = False,
        curve: CurveConfig | None = None,
        auth: PeerAuth | None = None,
        limits: Limits = DEFAULT_LIMITS,
        kv_layout: KVLayout | None = None,
        kv_transport: str | None = None,
        ucx_address: bytes | None = None,
        on_sent: Callable[[Message, zmq.MessageTracker], None] | None = None,
        check_handshake: HandshakeCheck | None = None,
        max_inflight: int = 64,
        max_peers: int = 4096,
        ordered: bool = False,
        senders: Mapping[Role, frozenset[type]] | None = None,
        ack_extra: Callable[[Handshake], dict] | None = None,
    ):
        self.engine_id = engine_id
        self.limits = limits
        self.kv_layout = kv_layout
        self.kv_transport = kv_transport
        self.ucx_address = ucx_address
        self._on_sent = on_sent
        self._endpoint = security.bind_endpoint(host, port, allow_wildcard)
        self._curve = curve
        self._auth_check = auth
        self._num_unproven = 0
        self._check_handshake = check_handshake
        self._max_inflight = max_inflight
        self._max_peers = max_peers
        self._ordered = ordered
        self._senders = senders  # role -> message types it may send; None: any
        self._ack_extra = ack_extra
        self._rejections = Rejections(f"server {engine_id}")
        # identity -> the peer's handshake, least recently seen first (bounded: identities of
        # closed connections are never announced, so old ones are evicted instead).
        self._peers: collections.OrderedDict[bytes, Handshake] = collections.OrderedDict()
        self._sock: zmq.asyncio.Socket | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._auth = None
        self._allow_list: security.ClientAllowList | None = None
        self._tasks: set[asyncio.Task] = set()
        self.address = ""  # tcp://host:port once started

    @property
    def num_rejected(self) -> int:
        """Frames dropped as malformed, oversized, of another version or of an unknown tag."""
        return self._rejections.num_rejected

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        return dict(self._rejections.by_reason)

    @property
    def num_auth_denied(self) -> int:
        """Peers refused for want of the deployment's credentials: CURVE keys not in the allow-list, hellos
        without a proof of its secret."""
        return (self._allow_list.num_denied if self._allow_list else 0) + self._num_unproven

    async def start(self) -> str:
        """Bind; return the address clients connect to. Idempotent."""
        if self._sock is not None:
            return self.address
        # A CURVE server owns its context: the ZAP authenticator it starts serves a whole context.
        self._ctx = zmq.asyncio.Context() if self._curve else zmq.asyncio.Context.instance()
        sock = self._ctx.socket(zmq.ROUTER)
        configure_socket(sock, self.limits, self._endpoint)
        self._auth, self._allow_list = security.configure_server(sock, self._ctx, self._curve)
        sock.bind(self._endpoint)
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    async def serve(self, handler: Handler) -> None:
        """Receive and answer messages until close() or cancellation."""
        await self.start()
        inflight = asyncio.Semaphore(self._max_inflight)
        while self._sock is not None:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._sock is None:
                    return  # closed under us
                raise
            received = self._parse(frames)
            if received is None:
                continue
            identity, corr, message = received
            if self._ordered:
                await self._dispatch(handler, identity, corr, message)
                continue
            await inflight.acquire()
            task = asyncio.create_task(self._dispatch(handler, identity, corr, message))
            self._tasks.add(task)
            task.add_done_callback(lambda t: (self._tasks.discard(t), inflight.release()))

    def _parse(self, frames: list[zmq.Frame]) -> tuple[bytes, bytes, Message] | None:
        if len(frames) < 3 or len(frames[1]) != len(NO_REPLY):
            self._rejections.reject("envelope", f"{len(frames)} frames, not [identity, id, message...]")
            return None
        identity, corr = frames[0].bytes, frames[1].bytes
        try:
            return identity, corr, codec.decode(frames[2:], self.limits)
        except VersionMismatchError as e:
            self._rejections.reject("version", str(e))
            # Answer so that the peer fails fast with a clear message instead of timing out.
            self._send_nowait(identity, corr, Error(ErrorCode.VERSION_MISMATCH, str(e)))
        except DecodeError as e:
            self._rejections.reject(rejection_reason(e), str(e))
        return None

    async def _dispatch(self, handler: Handler, identity: bytes, corr: bytes, message: Message) -> None:
        peer = self._peers.get(identity)
        try:
            if isinstance(message, Handshake):
                reply = await self._accept(identity, message)
            elif peer is None:  # a new connection (a reconnect) that has not said who it is: a push is lost
                self._rejections.reject("no_handshake", f"{type(message).__name__} before a handshake")
                reply = Error(ErrorCode.HANDSHAKE_REQUIRED, f"{self.engine_id}: handshake first")
            elif self._senders is not None and type(message) not in self._senders.get(peer.role, ()):
                what = f"{peer.role.value} peers may not send {type(message).__name__}"
                self._rejections.reject("unauthorized", f"{peer.engine_id}: {what}")
                reply = Error(ErrorCode.BAD_REQUEST, f"{self.engine_id}: {what}", getattr(message, "request_id", None))
            else:
                self._peers.move_to_end(identity)
                reply = await handler(message, peer)
        except ErrorReply as e:
            reply = e.error
        except Exception as e:  # a handler bug must not take the server down
            logger.exception("%s: handler failed on %s", self.engine_id, type(message).__name__)
            reply = Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}",
                          request_id=getattr(message, "request_id", None))
        if reply is not None:
            await self._send(identity, corr, reply)

    async def _accept(self, identity: bytes, hello: Handshake) -> HandshakeAck | Error:
        if hello.protocol_version != PROTOCOL_VERSION:
            return Error(ErrorCode.VERSION_MISMATCH,
                         f"{self.engine_id} speaks protocol {PROTOCOL_VERSION}, peer {hello.protocol_version}")
        auth = self._auth_check
        if auth is not None:
            refusal = auth.check_hello(hello.auth_nonce, hello.auth_proof, hello.role.value, hello.engine_id)
            if refusal is not None:
                self._num_unproven += 1
                self._rejections.reject("unauthenticated", f"{hello.role.value} {hello.engine_id}: {refusal}")
                return Error(ErrorCode.UNAUTHENTICATED, f"{self.engine_id}: {refusal}")
        if self._check_handshake is not None:
            refusal = await self._check_handshake(hello)
            if refusal is not None:
                logger.warning("%s: refused %s %s: %s", self.engine_id, hello.role.value, hello.engine_id, refusal)
                return Error(ErrorCode.INCOMPATIBLE, refusal)
        self._peers[identity] = hello
        self._peers.move_to_end(identity)
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)
        return HandshakeAck(PROTOCOL_VERSION, self.engine_id, kv_layout=self.kv_layout, kv_transport=self.kv_transport,
                            ucx_address=self.ucx_address, **(self._ack_extra(hello) if self._ack_extra else {}),
                            auth_proof=auth.ack(hello.auth_nonce, self.engine_id) if auth is not None else None)

    async def _send(self, identity: bytes, corr: bytes, reply: Message) -> None:
        if corr == NO_REPLY and not isinstance(reply, Error):
            return
        try:
            frames = codec.encode(reply)
        except codec.EncodeError:
            logger.exception("%s: cannot encode reply %s", self.engine_id, type(reply).__name__)
            frames = codec.encode(Error(ErrorCode.INTERNAL, "reply could not be encoded"))
        if self._sock is None:
            return
        # ROUTER drops messages to a peer that is gone or over its high-water mark instead of
        # blocking, so a dead peer cannot stall replies to the others.
        if self._on_sent is not None and len(frames) > 1:
            tracker = await self._sock.send_multipart([identity, corr, *frames], copy=False, track=True)
            self._on_sent(reply, tracker)
            return
        await self._sock.send_multipart([identity, corr, *frames], copy=False)

    def _send_nowait(self, identity: bytes, corr: bytes, reply: Message) -> None:
        task = asyncio.ensure_future(self._send(identity, corr, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None and self._curve:
            self._ctx.term()
        self._ctx = None

    async def __aenter__(self) -> ReplyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class PullChannel:
    """Receiving end of push channels (e.g. token deltas decode -> proxy), in arrival order."""

    def __init__(self, engine_id: str, *, max_queued: int = 10_000, **server_kwargs):
        self.server = ReplyServer(engine_id, ordered=True, **server_kwargs)
        self._queue: asyncio.Queue[tuple[Message, Handshake]] = asyncio.Queue(max_queued)
        self._loop_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def num_rejected(self) -> int:
        return self.server.num_rejected

    async def start(self) -> str:
        address = await self.server.start()
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self.server.serve(self._enqueue))
        return address

    async def _enqueue(self, message: Message, peer: Handshake) -> None:
        await self._queue.put((message, peer))  # a full queue stops reading: senders feel it
        return None

    async def recv(self, timeout: float | None = None) -> Message:
        return (await self.recv_from(timeout))[0]

    async def recv_from(self, timeout: float | None = None) -> tuple[Message, Handshake]:
        """The next message and the handshake of the peer that pushed it."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            raise ChannelTimeout(f"nothing received on {self.address} within {timeout}s") from None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Message:
        return await self.recv()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        await self.server.close()

    async def __aenter__(self) -> PullChannel:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
