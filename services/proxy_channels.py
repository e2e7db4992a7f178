"""The push channels a service streams tokens back on: one per proxy inbox, shared by that proxy's requests.

What one engine step makes for a proxy's requests leaves as one `TokenDeltas` message: `send_soon`
queues a delta, and a flush that runs once the step's streams have all queued theirs sends them
together (in order, errors on their own), so a step costs one message per proxy, not one per request.
A proxy that cannot be reached fails every request whose messages were waiting for it (`on_failure`).

Addresses come from the wire (a request's `reply_to`), so they are bounded: a channel no stream uses is
closed after `idle_seconds`, and past `max_channels` the least recently used idle ones are closed at
once; when every channel carries a live stream, a request for a new address is refused.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

from epdserve.transport.protocol import Error, TokenDelta, TokenDeltas
from epdserve.transport.channel import ChannelError
from epdserve.transport.request_client import PushChannel


class ProxyChannels:
    def __init__(self, push_kwargs: dict, max_channels: int = 64, idle_seconds: float = 30.0,
                 on_failure: Callable[[str, list[str], Exception], None] = lambda address, ids, exc: None) -> None:
        self._push_kwargs = push_kwargs  # engine_id, role, curve, timeout of every channel
        self.max_channels = max_channels
        self.idle_seconds = idle_seconds
        self.on_failure = on_failure  # (address, request ids whose messages were lost, why)
        self._outbox: dict[str, list[TokenDelta | Error]] = {}  # address -> messages not sent yet
        self._flushes: dict[str, asyncio.Task] = {}
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

    def send_soon(self, address: str, message: TokenDelta | Error) -> None:
        """Queue `message` for the proxy at `address` (a channel acquired by its request's stream)."""
        self._outbox.setdefault(address, []).append(message)
        if address not in self._flushes:
            self._users[address] += 1  # in use until flushed
            self._flushes[address] = asyncio.get_running_loop().create_task(self._flush(address))

    async def _flush(self, address: str) -> None:
        """Send what is queued for `address`, batch after batch, until nothing is left."""
        sending: list[TokenDelta | Error] = []
        try:
            while sending := self._outbox.pop(address, []):
                channel = self._channels[address]
                for batch in _batches(sending):
                    await channel.send(batch)
        except (ChannelError, TimeoutError) as exc:
            lost = sending + self._outbox.pop(address, [])
            self.on_failure(address, list(dict.fromkeys(m.request_id for m in lost)), exc)
        finally:
            del self._flushes[address]
            self.release(address)

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
        await asyncio.gather(*self._flushes.values(), return_exceptions=True)
        for address in list(self._channels):
            self._close(address)
        await asyncio.gather(*self._closing, return_exceptions=True)


def _batches(messages: list[TokenDelta | Error]):
    """Consecutive deltas as one TokenDeltas; an error on its own, in its place."""
    deltas: list[TokenDelta] = []
    for message in messages:
        if isinstance(message, TokenDelta):
            deltas.append(message)
            continue
        if deltas:
            yield TokenDeltas(tuple(deltas))
            deltas = []
        yield message
    if deltas:
        yield TokenDeltas(tuple(deltas))
