"""Connections to peers by address: opened on first use, shared by whoever uses them at once, closed once
unused.

Peer addresses come from the wire and from discovery, and peers come and go (a restarted pod has a new
address), so a map that only grew would keep a connection - a reconnecting ZMQ socket, a UCX endpoint -
to every peer ever seen. Here a connection that nobody holds is closed after `idle_seconds`, and past
`max_peers` the least recently used idle ones are closed at once; when every connection is held, a new
address is refused (`acquire` returns None). Callers hold a connection from `acquire` to `release`.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, Iterator, TypeVar

from epdserve.transport.channel.common import ChannelError

# How long a connection nobody holds stays open, unless a pool is told otherwise.
IDLE_SECONDS = 300.0
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PoolFull(ChannelError):
    """Every connection of the pool is held, so none makes room for a new peer."""


@dataclass(eq=False)
class _Entry(Generic[V]):
    value: V
    users: int = 0
    last_used: float = 0.0
    timer: asyncio.TimerHandle | None = None


class PeerPool(Generic[K, V]):
    def __init__(self, open: Callable[[K], V], close: Callable[[V], Awaitable[None] | None], *,
                 max_peers: int = 256, idle_seconds: float = IDLE_SECONDS) -> None:
        """`open(key)` makes a connection, `close(value)` ends one (a coroutine is run as a task)."""
        self._open, self._close_value = open, close
        self.max_peers = max_peers
        self.idle_seconds = idle_seconds
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The open connection to `key`, if any, without holding it."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def acquire(self, key: K) -> V | None:
        """The connection to `key` (opened if need be), held until `release`; None when the pool is full."""
        entry = self._entries.get(key)
        if entry is None:
            for idle in [k for k, e in self._entries.items() if not e.users]:
                if len(self._entries) < self.max_peers:
                    break
                self.discard(idle)
            if len(self._entries) >= self.max_peers:
                return None
            entry = self._entries[key] = _Entry(self._open(key))
        self._entries.move_to_end(key)
        entry.users += 1
        return entry.value

    def release(self, key: K, value: V) -> None:
        """One holder of `value` (from `acquire(key)`) is done with it. A no-op if it was discarded since."""
        entry = self._entries.get(key)
        if entry is None or entry.value is not value:
            return
        entry.users -= 1
        entry.last_used = time.monotonic()
        self._entries.move_to_end(key)
        if not entry.users and entry.timer is None:
            entry.timer = asyncio.get_running_loop().call_later(self.idle_seconds, self._close_if_idle, key, entry)

    @contextlib.contextmanager
    def holding(self, key: K) -> Iterator[V]:
        """`acquire` and `release` around a block; raises PoolFull instead of returning None."""
        value = self.acquire(key)
        if value is None:
            raise PoolFull(f"connections to {len(self)} peers are all in use")
        try:
            yield value
        finally:
            self.release(key, value)

    def discard(self, key: K, value: V | None = None) -> None:
        """Close the connection to `key` now, held or not (its holders' next use fails); with `value`, only
        if that is still the one."""
        entry = self._entries.get(key)
        if entry is None or (value is not None and entry.value is not value):
            return
        del self._entries[key]
        if entry.timer is not None:
            entry.timer.cancel()
        closing = self._close_value(entry.value)
        if inspect.isawaitable(closing):
            task = asyncio.ensure_future(closing)
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _close_if_idle(self, key: K, entry: _Entry[V]) -> None:
        entry.timer = None
        if self._entries.get(key) is not entry or entry.users:
            return
        left = entry.last_used + self.idle_seconds - time.monotonic()
        if left > 0:  # used again since the timer was set
            entry.timer = asyncio.get_running_loop().call_later(left, self._close_if_idle, key, entry)
        else:
            self.discard(key)

    async def close(self) -> None:
        """Close every connection, held or not, and wait until they are closed."""
        for key in list(self._entries):
            self.discard(key)
        await asyncio.gather(*self._closing, return_exceptions=True)
