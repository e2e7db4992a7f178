"""UCX in this process, for the UCX data path (path.py): ucxx imported on first use (the `ucx` extra) and
initialised once, endpoints to peer workers by their address (made on first use, shared, aborted once unused:
`Endpoints`), and tagged sends and receives posted straight from (into) the caller's memory and polled together
(`post`, `completed`).
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from epdserve.transport.channel.peer_pool import PeerPool
from epdserve.transport.kv.transfer import TransferError

# How often a transfer checks its UCX requests: often enough that a message's completion is seen at
# once, rarely enough to leave the cores to UCX's progress thread and the sockets (0.1 ms measured
# 3.2-3.9 GB/s on 2 cores; every turn of the loop 1.5-2.1; 2 ms 1.4-1.7).
POLL_SECONDS = 1e-4
_init_lock = threading.Lock()
_initialised = False


def import_ucxx() -> Any:
    """The ucxx module; ImportError (with the install hint) when the extra is not installed."""
    # ucxx reads this when it loads UCX; without it UCX warns about every unrelated UCX_* variable.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx
    except ImportError as e:
        raise ImportError("the UCX transfer backend needs the 'ucx' extra: pip install 'epdserve[ucx]'") from e
    return ucxx


# The settings UCX runs with unless `ucx_options` replace them.
# - Between hosts over TCP (the CPU case), UCX's defaults move 3-4x less than a plain socket: 8 KiB
#   TCP segments, and a rendezvous protocol that fragments through bounce buffers. Large segments and
#   eager sends of whole messages measured 3-5x faster. On RDMA fabrics, where rendezvous is zero-copy,
#   pass `ucx_options` without these.
# - On one host, UCX would use shared memory, but our endpoints ask for peer-failure handling (a dead
#   peer must fail a transfer, never the process), and UCX drops every shared-memory transport from
#   such endpoints: sysv/posix do not declare it, and CMA rendezvous lacks the memory invalidation it
#   then requires - so same-host transfers ran over TCP on loopback. POSIX_ERROR_HANDLING declares it
#   for the posix transport (whose segments are files, so a dead peer's memory stays mapped), which
#   UCX then picks for same-host peers: eager copies through shared memory, 5-6x a loopback socket.
#   Shared memory never detects a dead peer: the client watches the control connection instead.
#   Error handling stays on: without it a CMA read from a dead peer aborts the reader's process.
DEFAULT_OPTIONS = {"TCP_TX_SEG_SIZE": "1m", "TCP_RX_SEG_SIZE": "1m", "RNDV_THRESH": "inf",
                   "POSIX_ERROR_HANDLING": "y"}


def init_ucx(net_devices: str | None, ucx_options: Mapping[str, str] | None) -> Any:
    """ucxx, initialised once per process (the first caller's options apply to the process), its worker
    progressed by ucxx's thread for the running event loop (completions are polled: `completed`).
    `net_devices` and `ucx_options` as UcxServerPath's (path.py)."""
    global _initialised
    ucxx = import_ucxx()
    with _init_lock:
        if not _initialised:
            options = dict(DEFAULT_OPTIONS if ucx_options is None else ucx_options)
            if net_devices:
                options["NET_DEVICES"] = net_devices
            try:
                ucxx.init(options=options)  # progress thread: idle workers cost nothing
            except RuntimeError:
                pass  # initialised by other code of this process, with its options
            _initialised = True
    ucxx.continuous_ucx_progress()  # returns at once when this loop already has it
    return ucxx


class Endpoints:
    """UCX endpoints by the peer worker's address: made on first use, shared, aborted once unused for a
    while (a PeerPool: peers come and go). Each is held from `acquire` to `release`."""

    def __init__(self, ucxx: Callable[[], Any], idle_seconds: float) -> None:
        self._ucxx = ucxx  # the initialised ucxx module
        # address -> the task making its endpoint: ucxx makes endpoints in a coroutine, a pool opens at once
        self._pool: PeerPool[bytes, asyncio.Task] = PeerPool(
            lambda address: asyncio.ensure_future(self._make(address)), _abort_made, idle_seconds=idle_seconds)

    def __len__(self) -> int:
        return len(self._pool)

    async def _make(self, ucx_address: bytes) -> Any:
        ucxx = self._ucxx()
        try:
            return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(ucx_address))
        except Exception as e:  # UCX raises its own exception types
            raise TransferError(f"cannot reach the peer's UCX worker: {e}") from e

    async def acquire(self, ucx_address: bytes) -> Any:
        """The endpoint to the worker at `ucx_address`: the one in use, or a new one where there is none or
        it has closed (its peer failed). Raises TransferError."""
        for _ in range(2):
            making = self._pool.acquire(ucx_address)
            if making is None:
                raise TransferError(f"UCX endpoints to {len(self._pool)} peers are all in use")
            try:
                endpoint = await asyncio.shield(making)  # others may be waiting for it too
            except BaseException:
                self._let_go(ucx_address, making)
                raise
            if not endpoint.closed:
                return endpoint
            self._let_go(ucx_address, making)
        raise TransferError("a new UCX endpoint closed at once")

    def _let_go(self, ucx_address: bytes, making: asyncio.Task) -> None:
        """Release `making`, and drop it if it failed or made an endpoint that closed (not if we were
        cancelled while it ran): the next `acquire` makes a new one."""
        self._pool.release(ucx_address, making)
        if making.done():
            self._pool.discard(ucx_address, making)

    def release(self, ucx_address: bytes, endpoint: Any) -> None:
        making = self._pool.get(ucx_address)
        if making is not None and _made(making) is endpoint:
            self._pool.release(ucx_address, making)

    def abort(self, ucx_address: bytes, endpoint: Any) -> None:
        """Abort `endpoint` now (its sends and receives are cancelled); the next `acquire` makes a new one."""
        endpoint.abort()
        making = self._pool.get(ucx_address)
        if making is not None and _made(making) is endpoint:
            self._pool.discard(ucx_address, making)

    async def close(self) -> None:
        await self._pool.close()


def _made(making: asyncio.Task) -> Any:
    """The endpoint `making` made, or None (not yet, failed, or cancelled)."""
    if not making.done() or making.cancelled() or making.exception() is not None:
        return None
    return making.result()


def _abort_made(making: asyncio.Task) -> None:
    endpoint = _made(making)
    if endpoint is not None:
        endpoint.abort()
    elif not making.done():
        making.cancel()
    else:
        making.exception()  # retrieved, so asyncio does not log it as never retrieved


def post(endpoint: Any, buffers: list, tag: int, send: bool) -> list[Any]:
    """One UCX tag send (or receive) per non-empty buffer (flat bytes: a numpy array, or a device tensor's
    `as_bytes`), with tags tag, tag + 1, ..., straight from (into) the buffer's memory; the ucxx requests,
    for `completed`. ucxx's Endpoint.send/recv await each request
    on its own, polling with sleep(0): with a message's receives posted at once, that spun the event loop
    once per pending receive and took the cores the data needed (measured on 2 cores: 1.7 GB/s, against
    3.2-3.9 polled together). ucxx's progress modes that avoid it spin even while idle."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    ep = endpoint._ep  # the ucxx endpoint object behind the asyncio wrapper
    if ep is None:
        raise TransferError("UCX endpoint closed")
    ep.raise_on_error()
    if send:
        return [ep.tag_send(Array(b), Tag(tag + i)) for i, b in enumerate(buffers) if b.nbytes]
    return [ep.tag_recv(Array(b), Tag(tag + i), TagMaskFull) for i, b in enumerate(buffers) if b.nbytes]


class PeerLost(Exception):
    """The peer's control connection dropped while UCX requests to it were pending."""


async def completed(requests: list[Any], timeout: float, peer_lost: Callable[[], bool] | None = None) -> None:
    """Wait until every request completed (raising the first one's error), polling all of them every
    POLL_SECONDS; asyncio.TimeoutError after `timeout` seconds, PeerLost as soon as `peer_lost()`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not all(request.completed for request in requests):
        if loop.time() > deadline:
            raise asyncio.TimeoutError
        if peer_lost is not None and peer_lost():
            raise PeerLost
        await asyncio.sleep(POLL_SECONDS)
    for request in requests:
        request.check_error()
