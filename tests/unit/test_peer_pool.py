"""PeerPool: connections opened once per peer, shared, never closed while held, closed once idle or to make
room for a new peer."""
import asyncio

import pytest

from epdserve.transport.channel.peer_pool import PeerPool, PoolFull


class Connection:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False


def pool(closed: list[str], **kwargs) -> PeerPool[str, Connection]:
    async def close(connection: Connection) -> None:  # a coroutine, as a RequestClient's close
        connection.closed = True
        closed.append(connection.address)

    return PeerPool(Connection, close, **kwargs)


def test_one_connection_per_peer_shared_by_its_holders():
    async def main():
        closed = []
        peers = pool(closed)
        first, second = peers.acquire("a"), peers.acquire("a")
        assert first is second and first.address == "a" and len(peers) == 1
        assert peers.acquire("b") is not first and len(peers) == 2
        await peers.close()
        assert sorted(closed) == ["a", "b"]

    asyncio.run(main())


def test_a_connection_nobody_holds_is_closed_after_idle_seconds():
    async def main():
        closed = []
        peers = pool(closed, idle_seconds=0.2)
        idle, held = peers.acquire("idle"), peers.acquire("held")
        peers.release("idle", idle)
        await asyncio.sleep(0.1)
        assert closed == [] and peers.get("idle") is idle
        await asyncio.sleep(0.3)
        assert closed == ["idle"] and idle.closed and peers.get("idle") is None
        assert peers.get("held") is held and not held.closed  # held for longer than idle_seconds
        assert peers.acquire("idle") is not idle  # a new one
        await peers.close()

    asyncio.run(main())


def test_a_use_within_idle_seconds_postpones_the_close():
    async def main():
        closed = []
        peers = pool(closed, idle_seconds=0.3)
        connection = peers.acquire("a")
        peers.release("a", connection)
        await asyncio.sleep(0.2)
        with peers.holding("a") as again:
            assert again is connection
        await asyncio.sleep(0.2)  # 0.4 s after the first release, 0.2 s after the last
        assert closed == []
        await asyncio.sleep(0.2)
        assert closed == ["a"]

    asyncio.run(main())


def test_past_max_peers_the_least_recently_used_idle_connection_makes_room():
    async def main():
        closed = []
        peers = pool(closed, max_peers=3, idle_seconds=60)
        held = {a: peers.acquire(a) for a in "abc"}
        assert peers.acquire("d") is None  # all held
        with pytest.raises(PoolFull):
            with peers.holding("d"):
                pass
        peers.release("b", held["b"])
        peers.release("a", held["a"])
        assert peers.acquire("d") is not None  # b: the least recently used of those idle
        await asyncio.sleep(0)
        assert closed == ["b"] and len(peers) == 3
        assert peers.get("a") is held["a"] and peers.get("c") is held["c"]
        await peers.close()

    asyncio.run(main())


def test_a_discarded_connection_is_replaced_and_its_holders_release_nothing():
    async def main():
        closed = []
        peers = pool(closed, idle_seconds=0.1)
        old = peers.acquire("a")
        peers.discard("a")
        await asyncio.sleep(0)
        assert closed == ["a"] and old.closed
        new = peers.acquire("a")
        assert new is not old
        peers.release("a", old)  # the old holder: must not count against the new one
        peers.discard("a", old)  # nor close it
        await asyncio.sleep(0.3)
        assert peers.get("a") is new and not new.closed  # still held by its own holder
        await peers.close()

    asyncio.run(main())
