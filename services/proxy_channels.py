"""The push channels a service streams tokens back on: one per proxy inbox, shared by that proxy's requests.

Addresses come from the wire (a request's `reply_to`), so they are bounded: a channel no stream uses is
closed after `idle_seconds`, and past `max_channels` the least recently used idle ones are closed at
once; when every channel carries a live stream, a request for a new address is refused.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from epdserve.transport.queues import PushChannel


class ProxyChannels:
    def __init__(self, push_kwargs: dict, max_channels: int = 64, idle_seconds: float = 30.0) -> None:
        self._push_kwargs = push_kwargs  # engine_id, role, curve, timeout of every channel
        self.max_channels = max_channels
        self.idle_seconds = idle_seconds
        # address -> channel, least recently used first; streams and last use per address
        self._channels: OrderedDict[str, PushChannel] = OrderedDict()
        self._users: dict[str, int] = {}
        self._last_used: dict[str, float] = {}
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def acquire(self, address: str) -> PushChannel | None:
        """The channel to `address` for one more stream; None when the bound is reached by live streams."""
        if not address.startswith("tcp://"):
            raise ValueError(f"reply_to must be a tcp:// address, got {address[:64]!r}")
        channel = self._channels.get(address)
        if channel is None:
            for idle in [a for a in self._channels if not self._users[a]]:
                if len(self._channels) < self.max_channels:
                    break
                self._close(idle)
            if len(self._channels) >= self.max_channels:
                return None
            channel = self._channels[address] = PushChannel(address, **self._push_kwargs)
            self._users[address] = 0
        self._channels.move_to_end(address)
        self._users[address] += 1
        return channel

    def release(self, address: str) -> None:
        """One stream on `address` ended; the channel closes if no stream uses it for `idle_seconds`."""
        self._users[address] -= 1
        self._last_used[address] = time.monotonic()
        if not self._users[address]:
            asyncio.get_running_loop().call_later(self.idle_seconds, self._close_if_idle, address)

    def _close_if_idle(self, address: str) -> None:
        last = self._last_used.get(address)
        if address in self._channels and not self._users[address] and \
                last is not None and time.monotonic() - last >= self.idle_seconds * 0.99:
            self._close(address)

    def _close(self, address: str) -> None:
        channel = self._channels.pop(address)
        del self._users[address]
        self._last_used.pop(address, None)
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for address in list(self._channels):
            self._close(address)
        await asyncio.gather(*self._closing, return_exceptions=True)
