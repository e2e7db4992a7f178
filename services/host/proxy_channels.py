"""The push channels a service streams tokens back on: one per proxy inbox, shared by that proxy's requests.

What one engine step makes for a proxy's requests leaves as one `TokenDeltas` message: `send_soon`
queues a delta, and a flush that runs once the step's streams have all queued theirs sends them
together (in order, errors on their own), so a step costs one message per proxy, not one per request.
A proxy that cannot be reached fails every request whose messages were waiting for it (`on_failure`).

Addresses come from the wire (a request's `reply_to`), so the channels are a PeerPool: one no stream
uses is closed after `idle_seconds`, past `max_channels` the least recently used idle ones are closed at
once, and when every channel carries a live stream a request for a new address is refused.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from epdserve.transport.channel.common import ChannelError
from epdserve.transport.channel.peer_pool import PeerPool
from epdserve.transport.channel.protocol import Error, TokenDelta, TokenDeltas
from epdserve.transport.channel.request_client import PushChannel


class ProxyChannels:
    def __init__(self, push_kwargs: dict, max_channels: int = 64, idle_seconds: float = 30.0,
                 on_failure: Callable[[str, list[str], Exception], None] = lambda address, ids, exc: None) -> None:
        self.on_failure = on_failure  # (address, request ids whose messages were lost, why)
        self._outbox: dict[str, list[TokenDelta | Error]] = {}  # address -> messages not sent yet
        self._flushes: dict[str, asyncio.Task] = {}
        # push_kwargs: engine_id, role, curve, timeout of every channel
        self._channels: PeerPool[str, PushChannel] = PeerPool(
            lambda address: PushChannel(address, **push_kwargs), PushChannel.close,
            max_peers=max_channels, idle_seconds=idle_seconds)

    def __len__(self) -> int:
        return len(self._channels)

    def acquire(self, address: str) -> PushChannel | None:
        """The channel to `address` for one more stream; None when the bound is reached by live streams."""
        if not address.startswith("tcp://"):
            raise ValueError(f"reply_to must be a tcp:// address, got {address[:64]!r}")
        return self._channels.acquire(address)

    def release(self, address: str) -> None:
        """One stream on `address` ended; the channel closes if no stream uses it for `idle_seconds`."""
        self._channels.release(address, self._channels.get(address))

    def send_soon(self, address: str, message: TokenDelta | Error) -> None:
        """Queue `message` for the proxy at `address` (a channel acquired by its request's stream)."""
        self._outbox.setdefault(address, []).append(message)
        if address not in self._flushes:
            self._channels.acquire(address)  # in use until flushed: its stream holds it, so never None
            self._flushes[address] = asyncio.get_running_loop().create_task(self._flush(address))

    async def _flush(self, address: str) -> None:
        """Send what is queued for `address`, batch after batch, until nothing is left."""
        sending: list[TokenDelta | Error] = []
        try:
            while sending := self._outbox.pop(address, []):
                channel = self._channels.get(address)
                for batch in _batches(sending):
                    await channel.send(batch)
        except (ChannelError, TimeoutError) as exc:
            lost = sending + self._outbox.pop(address, [])
            self.on_failure(address, list(dict.fromkeys(m.request_id for m in lost)), exc)
        finally:
            del self._flushes[address]
            self.release(address)

    async def close(self) -> None:
        await asyncio.gather(*self._flushes.values(), return_exceptions=True)
        await self._channels.close()


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
