"""What both ends of a typed ZMQ channel share: the error types, the framing's no-reply marker, socket
settings and the counting of dropped frames.

The channels themselves are `reply_server.py` (ROUTER, binds: ReplyServer, PullChannel) and
`request_client.py` (DEALER, connects: RequestClient, PushChannel). Together:

    server = ReplyServer("prefill-0", host="127.0.0.1", port=0)   # ROUTER, binds
    await server.start(); asyncio.create_task(server.serve(handle))   # handle(message, peer) -> reply
    client = RequestClient(server.address, engine_id="proxy-0", role=Role.PROXY)   # DEALER
    status = await client.request(StatusRequest(), expect=Status)

The loops that use them see protocol messages, never sockets or bytes.

Frames: a DEALER sends [correlation id (8 bytes), *codec frames]; the ROUTER sees the connection's
identity in front and answers [identity, correlation id, *codec frames]. The correlation id lets one
connection carry many concurrent requests; all-zero means "no reply wanted" (push).

Every connection starts with a Handshake (protocol version, role, engine id, optional KV layout, and
the proof of the deployment's secret, peer_auth.py) which the server accepts or refuses before it passes
anything else to its handler; the HandshakeAck proves the secret back. A server that
restarts forgets its peers and answers HANDSHAKE_REQUIRED; the client then handshakes again and
retries once, so a reconnect is invisible to callers. ZMQ itself reconnects the TCP connection.

A frame that is malformed, oversized, of another protocol version or of an unknown tag is dropped
with a log line and counted in `num_rejected` / `rejected_by_reason`; the loop keeps serving.
Every await on a peer has a deadline: a dead peer raises ChannelTimeout, never hangs.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

import zmq

from epdserve.transport.channel.codec import DecodeError, Limits, VersionMismatchError
from epdserve.transport.channel.protocol import Error, Handshake, HandshakeAck, Message

logger = logging.getLogger(__name__)

NO_REPLY = bytes(8)

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


class ConnectionLost(ChannelError):
    """The connection dropped with the request in flight: the peer died or restarted, or it missed heartbeats
    (frozen, or starved of CPU for a moment) and is there still."""


class PeerUnreachable(ChannelError):
    """Nothing accepts connections at the peer's address (refused): its process is gone, or not up yet."""


class HandshakeError(ChannelError):
    """The peer refused our handshake (protocol version, KV layout, CURVE keys) or we refused its."""


class ErrorReply(ChannelError):
    """An `Error` message as an exception: raised by a client that received one, and raised by a
    server handler to send one."""

    def __init__(self, error: Error):
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error


HEARTBEAT_IVL_MS = 500  # a ping after this much silence on a connection
HEARTBEAT_TIMEOUT_MS = 1500  # ... and no traffic for this long after it: the connection is dropped


def configure_socket(sock: zmq.Socket, limits: Limits, endpoint: str) -> None:
    sock.linger = 0
    # IPv6 only for IPv6 endpoints ("tcp://[::1]:5", "tcp://[::]:*"): with it on, libzmq would bind
    # IPv4 hosts as mapped IPv6 addresses and could resolve a name to an address nothing listens on.
    sock.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))
    # libzmq's own cap: a peer announcing a bigger frame is disconnected before we allocate it.
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_message_bytes, limits.max_tensor_bytes))
    # Heartbeats find connections whose peer vanished without closing them (a frozen process, a host that
    # died): disconnected within 2 s. libzmq's I/O thread answers them, so a peer busy in Python still does.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class Rejections:
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


def rejection_reason(error: DecodeError) -> str:
    if isinstance(error, VersionMismatchError):
        return "version"
    return "oversized" if "exceeds the limit" in str(error) else "malformed"
