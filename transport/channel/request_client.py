"""The connecting end of typed channels: RequestClient (DEALER: handshakes on first use, then requests
and their replies, many in flight) and PushChannel (fire-and-forget messages in order). See common.py
for the framing and the handshake."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epdserve.transport.channel import codec, security
from epdserve.transport.channel.common import (
    NO_REPLY, AckCheck, ChannelError, ChannelTimeout, ConnectionLost, ErrorReply, HandshakeError, PeerUnreachable,
    Rejections, configure_socket, rejection_reason,
)
from epdserve.transport.channel.codec import DEFAULT_LIMITS, DecodeError, Limits, VersionMismatchError
from epdserve.transport.channel.protocol import (
    PROTOCOL_VERSION, Error, ErrorCode, Handshake, HandshakeAck, KVLayout, Message, Role,
)
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.security import CurveConfig

logger = logging.getLogger(__name__)

_M = TypeVar("_M")


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
        auth: PeerAuth | None = None,
        limits: Limits = DEFAULT_LIMITS,
        kv_layout: KVLayout | None = None,
        kv_transport: str | None = None,
        ucx_address: bytes | None = None,
        check_ack: AckCheck | None = None,
        fail_if_refused: bool = False,
    ):
        """`fail_if_refused`: a handshake raises PeerUnreachable as soon as a connect is refused (nothing
        listens at the address) instead of waiting, until its timeout, for a server to come back there - for
        peers whose state dies with their process (a restarted one holds none of it)."""
        self.address = address
        self.fail_if_refused = fail_if_refused
        self.timeout = timeout
        self.limits = limits
        self.peer: HandshakeAck | None = None  # the server's answer to our handshake
        self._hello = Handshake(PROTOCOL_VERSION, role, engine_id, kv_layout=kv_layout, kv_transport=kv_transport,
                                ucx_address=ucx_address)
        self._curve = curve
        self._auth = auth
        self._check_ack = check_ack
        self._rejections = Rejections(f"client of {address}")
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._refused: asyncio.Future | None = None  # set by the watcher while a handshake runs
        # Set by the watcher when a connect is refused while a handshake that fails on it runs.
        self._connect_refused: asyncio.Future | None = None
        # Set by the watcher when a connection is made while a hello sent during an outage waits for its answer.
        self._reconnected: asyncio.Future | None = None
        self.num_disconnects = 0
        # Loop time the connection dropped, until the next one is made (None: up, or never tried yet). A
        # dead peer's connection drops at once (its kernel closes it) or within a heartbeat timeout (a
        # frozen or unreachable host): callers route around it without waiting for a request to time out.
        self.down_since: float | None = None
        # Loop time a connect was first refused since the last connection was made (None: connected, or
        # nothing refused): nothing listens at the address, so whatever the peer held went with it.
        self.refused_since: float | None = None
        # Set as the connection drops: the connect-retried event that follows schedules the reconnect, it reports
        # no refused connect.
        self._reconnect_scheduled = False
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
            configure_socket(sock, self.limits, self.address)
            # Queue nothing for a peer we are not connected to: a send then waits (and times out)
            # instead of piling up for a server that may never come back.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            security.configure_client(sock, self._curve)
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES | zmq.EVENT_DISCONNECTED |
                                              zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED |
                                              zmq.EVENT_CONNECT_RETRIED)
            sock.connect(self.address)
            self._sock = sock
            self._handshake_lock = asyncio.Lock()
            self._reader = asyncio.create_task(self._read())
            self._watcher = asyncio.create_task(self._watch(monitor))
        return self._sock

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Connection events: a refused ZMTP handshake (CURVE), refused connects and dropped connections."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] & _HANDSHAKE_FAILURES:
                    if self._refused is not None and not self._refused.done():
                        self._refused.set_result(event)
                elif event["event"] == zmq.EVENT_CONNECTED:
                    self.refused_since = None
                    self._reconnect_scheduled = False
                elif event["event"] == zmq.EVENT_CONNECT_RETRIED and self._reconnect_scheduled:
                    # libzmq schedules the reconnect of a dropped connection with this event: no connect was
                    # tried yet, so nothing was refused (a peer that missed heartbeats may well be there).
                    self._reconnect_scheduled = False
                elif event["event"] == zmq.EVENT_CONNECT_RETRIED:  # a connect failed; ZMQ tries again
                    if self.refused_since is None:
                        self.refused_since = asyncio.get_running_loop().time()
                    if self._connect_refused is not None and not self._connect_refused.done():
                        self._connect_refused.set_result(event)
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.down_since = None
                    if self._reconnected is not None and not self._reconnected.done():
                        self._reconnected.set_result(event)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self.num_disconnects += 1
                    self._reconnect_scheduled = True
                    self.down_since = asyncio.get_running_loop().time()
                    self.peer = None  # a new connection is a new peer to the server
                    self._fail_pending(ConnectionLost(f"connection to {self.address} lost"))
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

    @property
    def is_down(self) -> bool:
        """The connection dropped and has not been made again."""
        return self.down_since is not None

    async def _ensure_handshake(self, deadline: float) -> None:
        self._socket()
        lock = self._handshake_lock
        # Waiting for another caller's handshake counts against this caller's deadline: a status poll
        # must not wait out the timeout of a request that started a handshake with a dead peer.
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(lock.acquire(), max(remaining, 0))
        except asyncio.TimeoutError:
            raise ChannelTimeout(f"no handshake answer from {self.address} in time (another request is "
                                 "waiting for one)") from None
        try:
            if self.peer is None:
                self.peer = await self._handshake(deadline)
        finally:
            lock.release()

    async def _handshake(self, deadline: float) -> HandshakeAck:
        self._socket()
        fail_if_refused = self.fail_if_refused
        if fail_if_refused and self.refused_since is not None:
            raise PeerUnreachable(f"{self.address} refuses connections: nothing listens there")
        loop = asyncio.get_running_loop()
        refused = self._refused = loop.create_future()
        unreachable = loop.create_future()
        if fail_if_refused:
            self._connect_refused = unreachable
        roundtrip = reconnected = None
        try:
            while True:
                # A hello sent just after the connection dropped can go into the dying connection (the
                # socket learns of the drop a moment after the monitor does) and be lost without a trace:
                # once the next connection is made, it is sent again (a repeated hello is answered alike).
                reconnected = self._reconnected = loop.create_future() if self.down_since is not None else None
                hello = self._proven_hello()
                roundtrip = asyncio.ensure_future(self._roundtrip(hello, deadline))
                await asyncio.wait({refused, roundtrip, unreachable, reconnected} - {None},
                                   return_when=asyncio.FIRST_COMPLETED)
                if roundtrip.done() or reconnected is None or not reconnected.done():
                    break
                roundtrip.cancel()
            if unreachable.done() and not roundtrip.done():
                raise PeerUnreachable(f"{self.address} refused the connection: nothing listens there")
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
            for fut in (refused, roundtrip, unreachable, reconnected):
                if fut is not None:
                    fut.cancel()
            self._refused = self._connect_refused = self._reconnected = None
        if isinstance(reply, Error):
            raise HandshakeError(f"{self.address} refused the handshake: {reply.code.value}: {reply.message}")
        if not isinstance(reply, HandshakeAck) or reply.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(f"{self.address} answered the handshake with {reply!r}")
        if self._auth is not None:
            refusal = self._auth.check_ack(hello.auth_nonce, reply.auth_proof, reply.engine_id)
            if refusal is not None:
                raise HandshakeError(f"{self.address} ({reply.engine_id}): {refusal}")
        if self._check_ack is not None:
            refusal = self._check_ack(reply)
            if refusal is not None:
                raise HandshakeError(f"{self.address} ({reply.engine_id}) is incompatible: {refusal}")
        return reply

    def _proven_hello(self) -> Handshake:
        """Our hello, with a fresh proof of the deployment's secret each time it is sent (a server admits
        a nonce once)."""
        if self._auth is None:
            return self._hello
        nonce, proof = self._auth.hello(self._hello.role.value, self._hello.engine_id)
        return dataclasses.replace(self._hello, auth_nonce=nonce, auth_proof=proof)

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
                self._rejections.reject(rejection_reason(e), str(e))
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
            # Unbind the monitor's inproc endpoint now: it is named after the socket's file number,
            # which the next socket may get before libzmq has reaped this one ("Address already in use").
            self._sock.disable_monitor()
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
