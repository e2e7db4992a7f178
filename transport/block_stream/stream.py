"""KV blocks over a plain TCP connection, straight from the server's cache into the client's: the block
connections' protocol, server and client.

The ZMQ transport's data path for blocks when its channel is not encrypted (path.py plugs it into a KV
transfer server and client). ZMQ frames cost the receiver a copy: libzmq receives each frame into memory of
its own and hands a multipart message over only whole, so the copy into the cache came after the last byte
(a 1k-token SmolLM2 fetch at 0.4-0.5x of a plain socket on 2 cores). Here the server writes each segment
from its cache with sendall and the client receives each one with recv_into into its destination blocks: the
kernel's copies and no other.

On a connection the client opens to the port its HandshakeAck announced (`data_port`):

    client: the HandshakeAck's `data_token`                          (once per connection)
    client: [u32 length][codec frame of FetchBlocks]                  (per fetch message)
    server: the raw bytes of the segments FetchBlocks describes, in its order, then the trailer
            [u32 length][codec frame of BlocksSent] with each segment's checksum; or, if it refuses
            the request, [u32 length][codec frame of Error] and it closes the connection

Nothing precedes the blocks: the client knows each segment's size from its own request (the
handshake made both sides' layouts equal) and reads exactly that, and a connection that ends early
carries the server's Error in its first bytes. (A reply header before the blocks, even a few bytes
sent with them, made a 1k-token fetch take 1.8x as long on 2 cores; the same bytes without it ran
as fast as a plain socket - so the checksums follow the blocks.) Both ends move a segment piece by
piece (`_HASH_PIECE_BYTES`) and hash each piece once the socket has copied it, while the CPU's caches
still hold it: while the socket would wait (for room to send, for data to arrive), or at once when
`_HASH_BACKLOG_BYTES` are left unhashed; the client compares the segments' checksums once the trailer
came (KVTransferClient.land). (Hashed whole, after a segment's last byte, they added 40-50% to a fetch on
2 busy cores; each piece hashed from memory before it left, the sender's took 11-17% of a fetch; now 3-7%
a side: benchmarks/results/transfer.md.) The token ties a connection to a peer the ZMQ channel accepted (protocol,
KV layout, role); the server checks every FetchBlocks against the blocks exposed for its request and
the generation it carries, as over ZMQ. With CURVE the server announces no port: blocks move as
encrypted ZMQ frames.

Both ends do their socket work on threads - blocking calls that release the GIL while the kernel
copies (and while XXH3 hashes). The server checks a request under `lock`, which the owner of the
blocks holds to withdraw them, and counts it as sending until its last byte left (`sending`); a fetch
waits for its thread to stop before it returns or fails, so no late byte lands in a block its caller
reuses.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from epdserve.transport.channel import codec
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.peer_pool import PeerPool
from epdserve.transport.channel.protocol import BlocksSent, Error, ErrorCode, FetchBlocks, Message
from epdserve.transport.kv import checksum
from epdserve.transport.kv.transfer import TransferError, TransferTimeout

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
_LENGTH_BYTES = 4

# Checks a request: its segments' bytes (flat uint8 arrays of the cache's memory, in order), or the
# Error to refuse it with. Called on a connection's thread with the server's lock held, the lock
# under which blocks are withdrawn.
Prepare = Callable[[FetchBlocks], "Sequence[np.ndarray] | Error"]
# A server closes connections idle this long; clients reuse none idle for half of it.
IDLE_SECONDS = 120.0
# Segments are sent, received and hashed in pieces of this size: a piece is hashed once the socket copied
# it, while the CPU's caches still hold it.
_HASH_PIECE_BYTES = 256 << 10
# Bytes sent or received but not hashed yet past which they are hashed before the socket is used again: the
# socket seldom waits on a fast peer, and bytes left longer fall out of the CPU's caches.
_HASH_BACKLOG_BYTES = 1 << 20
# Requests up to this size go out from the event loop: into an idle connection's empty send buffer
# (16 KiB at the least) they never block it.
_LOOP_SEND_BYTES = 8 << 10


class BlockStreamServer:
    """Serves FetchBlocks on plain TCP connections, one thread each.

    `prepare` checks a request and returns its segments or an Error; it runs under `lock`, which the
    owner of the blocks also holds while it withdraws a request's blocks, so a request checked is
    counted as sending (`sending`) before its blocks can be withdrawn and freed.
    """

    def __init__(self, engine_id: str, host: str, prepare: Prepare, *, port: int = 0,
                 limits: Limits = DEFAULT_LIMITS, max_connections: int = 256, lock: threading.Lock | None = None):
        self.engine_id = engine_id
        self.host = "0.0.0.0" if host == "*" else host  # ZMQ's wildcard, in socket terms
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.limits = limits
        self.port = port  # 0 until started: any free port
        self.num_rejected = 0  # connections with a wrong token, or malformed requests
        self._prepare = prepare
        self._max_connections = max_connections
        # Guards the three below and num_rejected, and the blocks `prepare` checks: the owner of the blocks'
        # lock, held while it withdraws them.
        self.lock = lock or threading.Lock()
        self._inflight: dict[str, set[socket.socket]] = {}  # request id -> connections sending its blocks
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None

    async def start(self) -> int:
        """Listen on the host the ZMQ channel binds (on a free port if `port` is 0); return the port."""
        if self._listener is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._listener = socket.create_server((self.host.strip("[]"), self.port), family=family, backlog=64)
            self.port = self._listener.getsockname()[1]
            threading.Thread(target=self._accept, name=f"{self.engine_id}-blocks-accept", daemon=True).start()
        return self.port

    def sending(self, request_id: str) -> bool:
        """Whether a connection still sends blocks of the request."""
        with self.lock:
            return request_id in self._inflight

    def abort(self, request_id: str) -> None:
        """Cut the connections still sending the request's blocks (their clients' fetches fail)."""
        with self.lock:
            connections = list(self._inflight.get(request_id, ()))
        for conn in connections:
            _shutdown(conn)

    def _accept(self) -> None:
        listener = self._listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                if self._listener is None or len(self._connections) >= self._max_connections:
                    logger.warning("%s: refused a block connection (%d open)", self.engine_id, len(self._connections))
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.engine_id}-blocks", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_SECONDS)
            if not hmac.compare_digest(_recv_bytes(conn, TOKEN_BYTES), self.token):
                self._reject("a block connection without the handshake's token")
                return
            while True:
                conn.settimeout(IDLE_SECONDS)
                try:
                    request = _recv_message(conn, self.limits)
                except EOFError:
                    return  # the client closed its connection
                # Blocking sends: the kernel copies as room frees up, where a socket with a timeout
                # polls and sends in smaller pieces (measured 1.5x slower). A client that stops
                # reading blocks the thread until `abort` cuts the connection.
                conn.settimeout(None)
                if not isinstance(request, FetchBlocks):
                    self._reject(f"{type(request).__name__} on a block connection")
                    return
                if not self._answer(conn, request):
                    return  # refused: the Error ends the connection
        except codec.DecodeError as e:
            self._reject(f"malformed block request: {e}")
        except (OSError, EOFError):
            pass  # the client went away (or idled out); its fetch, if any, fails on its side
        finally:
            with self.lock:
                self._connections.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket, request: FetchBlocks) -> bool:
        """Send the request's blocks and their checksums, or its Error; whether the connection goes on."""
        rid = request.request_id
        with self.lock:
            try:
                segments = self._prepare(request)
            except Exception as e:  # a bug here must not end the connection's thread unanswered
                logger.exception("%s: preparing blocks of %s failed", self.engine_id, rid)
                segments = Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", rid)
            if segments and not isinstance(segments, Error):
                self._inflight.setdefault(rid, set()).add(conn)
        if isinstance(segments, Error):
            conn.sendall(_frame(segments))
            return False
        try:
            sums = tuple(_send_hashed(conn, segment) for segment in segments)
            conn.sendall(_frame(BlocksSent(rid, len(segments), sums)))
            return True
        finally:
            if segments:
                with self.lock:
                    sending = self._inflight.get(rid, set())
                    sending.discard(conn)
                    if not sending:
                        self._inflight.pop(rid, None)

    def _reject(self, what: str) -> None:
        with self.lock:
            self.num_rejected += 1
        logger.warning("%s: dropped %s", self.engine_id, what)

    async def close(self) -> None:
        with self.lock:
            listener, self._listener = self._listener, None
            connections = list(self._connections)
        if listener is not None:
            _shutdown(listener)  # wakes the accept thread (closing alone would not)
            listener.close()
        for conn in connections:
            _shutdown(conn)


@dataclass(eq=False)
class _Server:
    """A client's block connections to one server: at most `slots` in use at once; those idle, with when
    they last ran; the token they began with."""
    slots: asyncio.Semaphore
    token: bytes | None = None
    idle: list[tuple[socket.socket, float]] = field(default_factory=list)

    def close_idle(self) -> None:
        for conn, _ in self.idle:
            conn.close()
        self.idle.clear()


class BlockStreamClient:
    """Fetches over block connections: at most `max_connections` per server at once, kept open
    between fetches; the receiving runs on a thread of the client's own."""

    def __init__(self, engine_id: str, *, limits: Limits = DEFAULT_LIMITS, max_connections: int = 4,
                 idle_seconds: float = IDLE_SECONDS / 2):
        self.engine_id = engine_id
        self.limits = limits
        self.max_connections = max_connections
        # (host, port) -> its connections; closed when no fetch went there for `idle_seconds` (servers come
        # and go), at most half the time a server keeps an idle connection open (it may be closing it)
        self._servers: PeerPool[tuple[str, int], _Server] = PeerPool(
            lambda peer: _Server(asyncio.Semaphore(max_connections)), _Server.close_idle,
            idle_seconds=min(idle_seconds, IDLE_SECONDS / 2))
        # The holders of the connections fetches are using (a thread may open one into its holder).
        self._busy: list[list[socket.socket]] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(max_connections, thread_name_prefix=f"{engine_id}-blocks")

    async def fetch(self, host: str, port: int, token: bytes, request: FetchBlocks,
                    buffers: Sequence[np.ndarray], timeout: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Send `request` and receive its segments into `buffers` (flat uint8 arrays of the sizes it
        asks for, in order); the checksums the server sent and those of the bytes that landed. Raises a
        TransferError subclass, or ErrorReply when the server answers with an Error."""
        peer = (host, port)
        server = self._servers.acquire(peer)
        if server is None:
            raise TransferError(f"block connections to {len(self._servers)} servers are all in use")
        try:
            return await self._fetch(peer, server, token, request, buffers, timeout)
        finally:
            self._servers.release(peer, server)

    async def _fetch(self, peer: tuple[str, int], server: _Server, token: bytes, request: FetchBlocks,
                     buffers: Sequence[np.ndarray], timeout: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
        deadline = time.monotonic() + timeout
        try:
            await asyncio.wait_for(server.slots.acquire(), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{peer[0]}:{peer[1]}: no block connection free in time") from None
        try:
            frame = _frame(request)
            holder = self._reuse(server, token)
            if holder and len(frame) <= _LOOP_SEND_BYTES:
                # Sent from here, so that the server works on it while the receiving thread wakes up.
                try:
                    holder[0].sendall(frame)
                    frame = None
                except OSError:
                    holder[0].close()
                    holder.clear()
            job = self._executor.submit(self._exchange, holder, peer, token, frame, request.request_id, buffers,
                                        deadline)
            self._busy.append(holder)
            try:
                sums = await asyncio.wrap_future(job)
            except asyncio.CancelledError:
                await _stopped(job, holder)
                raise
            except BaseException:
                for conn in holder:
                    conn.close()
                raise
            finally:
                self._busy.remove(holder)
            server.idle.append((holder[0], time.monotonic()))
            return sums
        finally:
            server.slots.release()

    def _reuse(self, server: _Server, token: bytes) -> list[socket.socket]:
        """[an idle connection to server], or [] to open one."""
        if server.token != token:  # a restarted server: its old connections lead nowhere
            server.close_idle()
            server.token = token
        while server.idle:
            conn, since = server.idle.pop()
            if time.monotonic() - since < IDLE_SECONDS / 2:
                return [conn]
            conn.close()  # the server may be closing it
        return []

    def _exchange(self, holder: list[socket.socket], peer: tuple[str, int], token: bytes, frame: bytes | None,
                  request_id: str, buffers: Sequence[np.ndarray],
                  deadline: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """On the client's thread: send `frame` (the request, unless the loop did) over holder's connection
        (opened here when holder is empty), receive the answer into `buffers`, taking each one's checksum as
        it lands, and the trailer; (the checksums sent, those taken)."""
        try:
            if not holder:
                holder.append(socket.create_connection(peer, timeout=_remaining(deadline)))
                holder[0].settimeout(None)  # blocking, see _receive_timeout
                holder[0].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                holder[0].sendall(token)
            conn = holder[0]
            if frame is not None:
                conn.sendall(frame)
            _receive_timeout(conn, deadline)
            num_bytes, landed = 0, []
            for buffer in buffers:
                digest = checksum.running()
                try:
                    num_bytes += _recv_into(conn, memoryview(buffer), deadline, digest)
                except EOFError as e:
                    raise self._refusal(peer, buffers, num_bytes + e.args[1]) from None
                landed.append(digest.intdigest())
            trailer = _recv_message(conn, self.limits)
            if (not isinstance(trailer, BlocksSent) or trailer.request_id != request_id
                    or trailer.num_segments != len(buffers)):
                raise TransferError(f"{peer[0]}:{peer[1]} ended its blocks with {type(trailer).__name__}, not the "
                                    f"checksums of {len(buffers)} segments of {request_id!r}")
            return trailer.checksums, tuple(landed)
        except (socket.timeout, BlockingIOError):  # the deadline, or SO_RCVTIMEO's
            raise TransferTimeout(f"{peer[0]}:{peer[1]}: blocks did not arrive in time") from None
        except (OSError, EOFError) as e:
            raise TransferError(f"block connection to {peer[0]}:{peer[1]} failed: {e or type(e).__name__}") from None
        except codec.DecodeError as e:
            raise TransferError(f"{peer[0]}:{peer[1]} sent a malformed block reply: {e}") from None

    def _refusal(self, peer: tuple[str, int], buffers: Sequence[np.ndarray], got: int) -> Exception:
        """Why a connection ended after `got` bytes: the server's Error, which then fills exactly the
        first bytes received (into the buffers, in order), or a broken connection."""
        if _LENGTH_BYTES < got <= _LENGTH_BYTES + self.limits.max_message_bytes:
            head = bytearray()
            for buffer in buffers:
                head += memoryview(buffer)[:got - len(head)]
                if len(head) == got:
                    break
            if int.from_bytes(head[:_LENGTH_BYTES], "little") == got - _LENGTH_BYTES:
                try:
                    error = codec.decode([bytes(head[_LENGTH_BYTES:])], self.limits)
                except codec.DecodeError:
                    error = None
                if isinstance(error, Error):
                    return ErrorReply(error)
        return TransferError(f"block connection to {peer[0]}:{peer[1]} closed after {got} bytes")

    async def close(self) -> None:
        """Close every connection; fetches still running fail (their threads stop at once)."""
        for holder in self._busy:
            for conn in holder:
                _shutdown(conn)
        await self._servers.close()
        self._executor.shutdown(wait=False)


async def _stopped(job: concurrent.futures.Future, holder: list[socket.socket]) -> None:
    """After a cancelled fetch: unblock its thread and wait until it no longer writes into the cache."""
    for conn in holder:
        _shutdown(conn)
    while not job.done():
        if holder:
            _shutdown(holder[0])  # the thread may have opened it since
        await asyncio.sleep(0.001)
    for conn in holder:
        conn.close()


def _receive_timeout(conn: socket.socket, deadline: float) -> None:
    """Bound each receive by the time left (SO_RCVTIMEO) on a blocking socket: a socket with a Python
    timeout polls before every receive and gets the data in smaller pieces (measured 1.5x slower)."""
    seconds = _remaining(deadline)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise socket.timeout("deadline passed")
    return remaining


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more)


def _frame(message: Message) -> bytes:
    (frame,) = codec.encode(message)  # messages without tensors are one frame
    return len(frame).to_bytes(_LENGTH_BYTES, "little") + bytes(frame)


def _recv_message(conn: socket.socket, limits: Limits) -> Message:
    length = int.from_bytes(_recv_bytes(conn, _LENGTH_BYTES), "little")
    if length > limits.max_message_bytes:
        raise codec.DecodeError(f"message of {length} bytes exceeds {limits.max_message_bytes}")
    return codec.decode([_recv_bytes(conn, length)], limits)


def _recv_bytes(conn: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    _recv_into(conn, memoryview(buffer))
    return bytes(buffer)


def _send_hashed(conn: socket.socket, segment: np.ndarray) -> int:
    """Send a segment, hashing what the socket has copied while it would wait for room (the copy read it from
    memory, the hash then finds it in the CPU's caches; a backlog past _HASH_BACKLOG_BYTES is hashed at
    once, while they still hold it); the segment's checksum."""
    digest = checksum.running()
    sent = hashed = 0
    while sent < segment.nbytes:
        piece = segment[sent:sent + _HASH_PIECE_BYTES]
        if hashed < sent:
            try:
                sent += conn.send(piece, socket.MSG_DONTWAIT)
            except BlockingIOError:  # no room now: hash instead of waiting for it
                hashed = _hash_next(digest, segment, hashed, sent)
                continue
        else:
            sent += conn.send(piece)
        while sent - hashed > _HASH_BACKLOG_BYTES:
            hashed = _hash_next(digest, segment, hashed, sent)
    digest.update(segment[hashed:])
    return digest.intdigest()


def _recv_into(conn: socket.socket, view: memoryview, deadline: float | None = None, digest=None) -> int:
    """Fill `view`; with a deadline, checked between receives (a peer trickling bytes cannot hold
    the connection past it); with `digest` (checksum.running()), hashing what arrived while the socket has
    nothing more yet (a backlog past _HASH_BACKLOG_BYTES at once), while the CPU's caches still hold it.
    EOFError(message, bytes received) when the peer closes first."""
    got = hashed = 0
    while got < view.nbytes:
        if digest is not None and hashed < got:
            try:
                n = conn.recv_into(view[got:got + _HASH_PIECE_BYTES], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:  # nothing arrived yet: hash instead of waiting for it
                hashed = _hash_next(digest, view, hashed, got)
                continue
        else:
            n = conn.recv_into(view[got:got + _HASH_PIECE_BYTES] if digest is not None else view[got:])
        if n == 0:
            raise EOFError("connection closed by the peer", got)
        got += n
        while digest is not None and got - hashed > _HASH_BACKLOG_BYTES:
            hashed = _hash_next(digest, view, hashed, got)
        if deadline is not None and got < view.nbytes:
            _remaining(deadline)
    if digest is not None:
        digest.update(view[hashed:got])
    return got


def _hash_next(digest, buffer, hashed: int, end: int) -> int:
    """Hash `buffer`'s next piece from `hashed` (at most up to `end`); where hashing got to."""
    upto = min(hashed + _HASH_PIECE_BYTES, end)
    digest.update(buffer[hashed:upto])
    return upto
