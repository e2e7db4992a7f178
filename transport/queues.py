"""Typed async channels over ZMQ: request/reply and push/pull, both on ROUTER (bind) / DEALER (connect).

The loops that use them see protocol messages, never sockets or bytes:

    server = ReplyServer("prefill-0", host="127.0.0.1", port=0)   # ROUTER, binds
    await server.start(); asyncio.create_task(server.serve(handle))   # handle(message, peer) -> reply
    client = RequestClient(server.address, engine_id="proxy-0", role=Role.PROXY)   # DEALER
    status = await client.request(StatusRequest(), expect=Status)

Frames: a DEALER sends [correlation id (8 bytes), *codec frames]; the ROUTER sees the connection's
identity in front and answers [identity, correlation id, *codec frames]. The correlation id lets one
connection carry many concurrent requests; all-zero means "no reply wanted" (push).

Every connection starts with a Handshake (protocol version, role, engine id, optional KV layout)
which the server accepts or refuses before it passes anything else to its handler. A server that
restarts forgets its peers and answers HANDSHAKE_REQUIRED; the client then handshakes again and
retries once, so a reconnect is invisible to callers. ZMQ itself reconnects the TCP connection.

A frame that is malformed, oversized, of another protocol version or of an unknown tag is dropped
with a log line and counted in `num_rejected` / `rejected_by_reason`; the loop keeps serving.
Every await on a peer has a deadline: a dead peer raises ChannelTimeout, never hangs.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epdserve.transport.protocol import (
    PROTOCOL_VERSION, Error, ErrorCode, Handshake, HandshakeAck, KVLayout, Message, Role,
)
from epdserve.transport import codec, security
from epdserve.transport.codec import DEFAULT_LIMITS, DecodeError, Limits, VersionMismatchError
from epdserve.transport.security import CurveConfig

logger = logging.getLogger(__name__)

NO_REPLY = bytes(8)
_M = TypeVar("_M")

# Handler of a ReplyServer: (message, the peer's handshake) -> reply, or None for no reply.
Handler = Callable[[Message, Handshake], Awaitable["Message | None"]]
# Extra handshake check of a server: refusal reason, or None to accept.
HandshakeCheck = Callable[[Handshake], Awaitable["str | None"]]
# Extra check of the server's HandshakeAck on the client: refusal reason, or None to accept.
AckCheck = Callable[[HandshakeAck], "str | None"]


class ChannelError(Exception):
    """A channel could not deliver a message or get its answer."""


class ChannelTimeout(ChannelError, TimeoutError):
    """The peer did not answer in time: it is down, unreachable, overloaded or refusing us."""


class HandshakeError(ChannelError):
    """The peer refused our handshake (protocol version, KV layout, CURVE keys) or we refused its."""


class ErrorReply(ChannelError):
    """An `Error` message as an exception: raised by a client that received one, and raised by a
    server handler to send one."""

    def __init__(self, error: Error):
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error


def _configure(sock: zmq.Socket, limits: Limits, endpoint: str) -> None:
    sock.linger = 0
    # IPv6 only for IPv6 endpoints ("tcp://[::1]:5", "tcp://[::]:*"): with it on, libzmq would bind
    # IPv4 hosts as mapped IPv6 addresses and could resolve a name to an address nothing listens on.
    sock.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))
    # libzmq's own cap: a peer announcing a bigger frame is disconnected before we allocate it.
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_message_bytes, limits.max_tensor_bytes))
    # Heartbeats find connections whose peer vanished without closing them (a host that died).
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)


class _Rejections:
    """Counts dropped frames by reason; the services export the counts as a metric."""

    def __init__(self, where: str):
        self.where = where
        self.num_rejected = 0
        self.by_reason: collections.Counter[str] = collections.Counter()

    def reject(self, reason: str, detail: str) -> None:
        self.num_rejected += 1
        self.by_reason[reason] += 1
        # Every rejection is counted, but a flood of garbage must not flood the log as well.
        if self.num_rejected <= 100 or self.num_rejected % 1000 == 0:
            logger.warning("%s: dropped a %s frame (%d dropped so far): %s",
                           self.where, reason, self.num_rejected, detail)


def _reason(error: DecodeError) -> str:
    if isinstance(error, VersionMismatchError):
        return "version"
    return "oversized" if "exceeds the limit" in str(error) else "malformed"


class ReplyServer:
    """ROUTER side: accepts handshakes, then passes each message to a handler and sends its reply.

    Handlers run concurrently (at most `max_inflight` at once; beyond that the socket is not read,
    which pushes back on senders). With `ordered=True` each message is handled to completion before
    the next is read, which keeps a stream's order. With `senders`, a message its peer's role may not
    send is refused (an Error reply) and counted as rejected.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_wildcard: bool = False,
        curve: CurveConfig | None = None,
        limits: Limits = DEFAULT_LIMITS,
        kv_layout: KVLayout | None = None,
        ucx_address: bytes | None = None,
        check_handshake: HandshakeCheck | None = None,
        max_inflight: int = 64,
        max_peers: int = 4096,
        ordered: bool = False,
        senders: Mapping[Role, frozenset[type]] | None = None,
    ):
        self.engine_id = engine_id
        self.limits = limits
        self.kv_layout = kv_layout
        self.ucx_address = ucx_address
        self._endpoint = security.bind_endpoint(host, port, allow_wildcard)
        self._curve = curve
        self._check_handshake = check_handshake
        self._max_inflight = max_inflight
        self._max_peers = max_peers
        self._ordered = ordered
        self._senders = senders  # role -> message types it may send; None: any
        self._rejections = _Rejections(f"server {engine_id}")
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
        """CURVE clients refused by the allow-list."""
        return self._allow_list.num_denied if self._allow_list else 0

    async def start(self) -> str:
        """Bind; return the address clients connect to. Idempotent."""
        if self._sock is not None:
            return self.address
        # A CURVE server owns its context: the ZAP authenticator it starts serves a whole context.
        self._ctx = zmq.asyncio.Context() if self._curve else zmq.asyncio.Context.instance()
        sock = self._ctx.socket(zmq.ROUTER)
        _configure(sock, self.limits, self._endpoint)
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
            self._rejections.reject(_reason(e), str(e))
        return None

    async def _dispatch(self, handler: Handler, identity: bytes, corr: bytes, message: Message) -> None:
        peer = self._peers.get(identity)
        try:
            if isinstance(message, Handshake):
                reply = await self._accept(identity, message)
            elif peer is None:
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
        if self._check_handshake is not None:
            refusal = await self._check_handshake(hello)
            if refusal is not None:
                logger.warning("%s: refused %s %s: %s", self.engine_id, hello.role.value, hello.engine_id, refusal)
                return Error(ErrorCode.INCOMPATIBLE, refusal)
        self._peers[identity] = hello
        self._peers.move_to_end(identity)
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)
        return HandshakeAck(PROTOCOL_VERSION, self.engine_id, self.kv_layout, self.ucx_address)

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


_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class RequestClient:
    """DEALER side: handshakes on first use, then sends requests and awaits their replies.

    Many requests may be in flight at once. An `Error` reply raises ErrorReply; no reply within the
    timeout raises ChannelTimeout. The connection to a restarted server is re-established by ZMQ and
    the handshake is redone transparently. When the connection drops (the peer's process died, or
    heartbeats stopped), requests waiting on it fail at once with ChannelError - their answers can no
    longer arrive - and `num_disconnects` goes up, so callers that wait on a peer can tell.
    """

    def __init__(
        self,
        address: str,
        *,
        engine_id: str,
        role: Role,
        timeout: float = 10.0,
        curve: CurveConfig | None = None,
        limits: Limits = DEFAULT_LIMITS,
        kv_layout: KVLayout | None = None,
        ucx_address: bytes | None = None,
        check_ack: AckCheck | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.limits = limits
        self.peer: HandshakeAck | None = None  # the server's answer to our handshake
        self._hello = Handshake(PROTOCOL_VERSION, role, engine_id, kv_layout, ucx_address)
        self._curve = curve
        self._check_ack = check_ack
        self._rejections = _Rejections(f"client of {address}")
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._refused: asyncio.Future | None = None  # set by the watcher while a handshake runs
        self.num_disconnects = 0
        self._pending: dict[bytes, asyncio.Future] = {}
        self._corr_ids = itertools.count(1)
        self._handshake_lock: asyncio.Lock | None = None
        self._closed = False

    @property
    def num_rejected(self) -> int:
        return self._rejections.num_rejected

    def _socket(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise ChannelError(f"client of {self.address} is closed")
        if self._sock is None:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            _configure(sock, self.limits, self.address)
            # Queue nothing for a peer we are not connected to: a send then waits (and times out)
            # instead of piling up for a server that may never come back.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            security.configure_client(sock, self._curve)
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES | zmq.EVENT_DISCONNECTED)
            sock.connect(self.address)
            self._sock = sock
            self._handshake_lock = asyncio.Lock()
            self._reader = asyncio.create_task(self._read())
            self._watcher = asyncio.create_task(self._watch(monitor))
        return self._sock

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Connection events: a refused ZMTP handshake (CURVE) and dropped connections."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] & _HANDSHAKE_FAILURES:
                    if self._refused is not None and not self._refused.done():
                        self._refused.set_result(event)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self.num_disconnects += 1
                    self.peer = None  # a new connection is a new peer to the server
                    self._fail_pending(ChannelError(f"connection to {self.address} lost"))
        finally:
            monitor.close(linger=0)

    async def connect(self, timeout: float | None = None) -> HandshakeAck:
        """Handshake now (otherwise the first request does). Raises HandshakeError if refused."""
        deadline = self._deadline(timeout)
        await self._ensure_handshake(deadline)
        assert self.peer is not None
        return self.peer

    async def request(self, message: Message, *, timeout: float | None = None, expect: type[_M] | None = None) -> _M:
        """Send `message` and return the reply (of type `expect`, if given)."""
        deadline = self._deadline(timeout)
        await self._ensure_handshake(deadline)
        reply = await self._roundtrip(message, deadline)
        if isinstance(reply, Error) and reply.code is ErrorCode.HANDSHAKE_REQUIRED:
            self.peer = None  # the server restarted (or evicted us): introduce ourselves again
            await self._ensure_handshake(deadline)
            reply = await self._roundtrip(message, deadline)
        if isinstance(reply, Error):
            raise ErrorReply(reply)
        if expect is not None and not isinstance(reply, expect):
            raise ChannelError(f"{self.address} answered {type(message).__name__} with "
                               f"{type(reply).__name__}, expected {expect.__name__}")
        return reply

    async def push(self, message: Message, *, timeout: float | None = None) -> None:
        """Send without awaiting a reply (at most once: lost if the server restarts meanwhile)."""
        deadline = self._deadline(timeout)
        await self._ensure_handshake(deadline)
        await self._send(NO_REPLY, message, deadline)

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)

    async def _ensure_handshake(self, deadline: float) -> None:
        self._socket()
        async with self._handshake_lock:
            if self.peer is None:
                self.peer = await self._handshake(deadline)

    async def _handshake(self, deadline: float) -> HandshakeAck:
        self._socket()
        refused = self._refused = asyncio.get_running_loop().create_future()
        roundtrip = asyncio.ensure_future(self._roundtrip(self._hello, deadline))
        try:
            await asyncio.wait({refused, roundtrip}, return_when=asyncio.FIRST_COMPLETED)
            if refused.done():  # checked first: the dropped connection that follows fails the roundtrip too
                event = refused.result()
                # A wrong server key and a peer dying mid-handshake look the same from here (NO_DETAIL).
                cause = ("the peer closed it mid-handshake: wrong server key, or the peer went down"
                         if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                         else "CURVE keys not accepted or security settings differ")
                raise HandshakeError(f"{self.address} refused the connection "
                                     f"({zmq.Event(event['event']).name}, errno {event['value']}): {cause}")
            reply = roundtrip.result()
        except VersionMismatchError as e:
            raise HandshakeError(f"{self.address}: {e}") from None
        except ChannelTimeout:
            raise ChannelTimeout(f"no handshake answer from {self.address}: peer down, unreachable, "
                                 "or not completing the CURVE handshake") from None
        finally:
            for fut in (refused, roundtrip):
                fut.cancel()
            self._refused = None
        if isinstance(reply, Error):
            raise HandshakeError(f"{self.address} refused the handshake: {reply.code.value}: {reply.message}")
        if not isinstance(reply, HandshakeAck) or reply.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(f"{self.address} answered the handshake with {reply!r}")
        if self._check_ack is not None:
            refusal = self._check_ack(reply)
            if refusal is not None:
                raise HandshakeError(f"{self.address} ({reply.engine_id}) is incompatible: {refusal}")
        return reply

    async def _roundtrip(self, message: Message, deadline: float) -> Message:
        corr = next(self._corr_ids).to_bytes(len(NO_REPLY), "little")
        future = asyncio.get_running_loop().create_future()
        self._pending[corr] = future
        try:
            await self._send(corr, message, deadline)
            remaining = deadline - asyncio.get_running_loop().time()
            return await asyncio.wait_for(future, max(remaining, 0))
        except asyncio.TimeoutError:
            raise ChannelTimeout(f"no reply from {self.address} to {type(message).__name__} in time") from None
        finally:
            self._pending.pop(corr, None)

    async def _send(self, corr: bytes, message: Message, deadline: float) -> None:
        frames = [corr, *codec.encode(message)]
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._socket().send_multipart(frames, copy=False), max(remaining, 0))
        except asyncio.TimeoutError:
            raise ChannelTimeout(f"could not send {type(message).__name__} to {self.address} in time "
                                 "(not connected)") from None

    async def _read(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) < 2 or len(frames[0]) != len(NO_REPLY):
                self._rejections.reject("envelope", f"{len(frames)} frames")
                continue
            corr = frames[0].bytes
            try:
                message = codec.decode(frames[1:], self.limits)
            except DecodeError as e:
                self._rejections.reject(_reason(e), str(e))
                message = e
            if corr == NO_REPLY:
                # Unsolicited: the server lost our handshake while we were pushing.
                if isinstance(message, Error) and message.code is ErrorCode.HANDSHAKE_REQUIRED:
                    self.peer = None
                continue
            future = self._pending.get(corr)
            if future is None or future.done():
                continue  # the answer to a request that already timed out
            if isinstance(message, Exception):
                future.set_exception(message)
            else:
                future.set_result(message)

    def _fail_pending(self, error: ChannelError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # its waiter may be gone already: no "never retrieved" warning

    async def close(self) -> None:
        self._closed = True
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._reader = self._watcher = None
        self._fail_pending(ChannelError(f"client of {self.address} closed"))
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> RequestClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class PushChannel:
    """Sending end of a push channel: typed, handshaken, fire-and-forget messages in order."""

    def __init__(self, address: str, *, engine_id: str, role: Role, **client_kwargs):
        self.client = RequestClient(address, engine_id=engine_id, role=role, **client_kwargs)

    async def connect(self, timeout: float | None = None) -> HandshakeAck:
        return await self.client.connect(timeout)

    async def send(self, message: Message, *, timeout: float | None = None) -> None:
        await self.client.push(message, timeout=timeout)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> PushChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
