"""Push channels back to proxies: shared per address, bounded in number, closed when idle (real sockets)."""
import asyncio

import pytest

from epdserve.services.host.proxy_channels import ProxyChannels
from epdserve.transport.channel import protocol as p
from epdserve.transport.channel.reply_server import PullChannel


def channels(**kwargs) -> ProxyChannels:
    return ProxyChannels(dict(engine_id="decode-0", role=p.Role.DECODE, timeout=2.0), **kwargs)


def test_streams_to_one_proxy_share_its_channel():
    async def main():
        async with PullChannel("proxy-0") as inbox:
            pool = channels()
            first, second = pool.acquire(inbox.address), pool.acquire(inbox.address)
            assert first is second and len(pool) == 1
            await first.send(p.TokenDelta("r1", (5,)))
            assert await inbox.recv(timeout=5) == p.TokenDelta("r1", (5,))
            await pool.close()

    asyncio.run(main())


def test_the_number_of_channels_is_bounded():
    async def main():
        pool = channels(max_channels=4, idle_seconds=60)
        addresses = [f"tcp://127.0.0.1:{port}" for port in range(1, 12)]
        held = [pool.acquire(a) for a in addresses[:4]]
        assert all(held) and len(pool) == 4
        assert pool.acquire(addresses[4]) is None  # every channel carries a live stream
        for a in addresses[:4]:
            pool.release(a)
        for a in addresses[4:]:  # idle ones make room, least recently used first
            assert pool.acquire(a) is not None
            pool.release(a)
            assert len(pool) <= 4
        await pool.close()

    asyncio.run(main())


def test_idle_channels_are_closed():
    async def main():
        pool = channels(idle_seconds=0.2)
        pool.acquire("tcp://127.0.0.1:9")
        pool.release("tcp://127.0.0.1:9")
        pool.acquire("tcp://127.0.0.1:10")  # still streaming: stays
        await asyncio.sleep(0.5)
        assert len(pool) == 1 and pool.acquire("tcp://127.0.0.1:10") is not None
        await pool.close()

    asyncio.run(main())


@pytest.mark.parametrize("address", ["ipc:///tmp/x", "inproc://x", "", "http://127.0.0.1:1"])
def test_reply_addresses_must_be_tcp(address):
    async def main():
        with pytest.raises(ValueError, match="tcp://"):
            channels().acquire(address)

    asyncio.run(main())


def test_what_is_queued_together_leaves_as_one_message_in_order():
    async def main():
        async with PullChannel("proxy-0") as inbox:
            pool = channels()
            pool.acquire(inbox.address)
            for message in (p.TokenDelta("a", (1,)), p.TokenDelta("b", (2,)), p.Error(p.ErrorCode.INTERNAL, "x", "c"),
                            p.TokenDelta("a", (3,))):
                pool.send_soon(inbox.address, message)  # one engine step's worth, queued without awaiting
            assert await inbox.recv(timeout=5) == p.TokenDeltas((p.TokenDelta("a", (1,)), p.TokenDelta("b", (2,))))
            assert await inbox.recv(timeout=5) == p.Error(p.ErrorCode.INTERNAL, "x", "c")
            assert await inbox.recv(timeout=5) == p.TokenDeltas((p.TokenDelta("a", (3,)),))
            await pool.close()

    asyncio.run(main())


def test_an_unreachable_proxy_fails_the_requests_whose_tokens_it_lost():
    async def main():
        lost = asyncio.get_running_loop().create_future()
        pool = ProxyChannels(dict(engine_id="decode-0", role=p.Role.DECODE, timeout=0.5),
                             on_failure=lambda address, ids, exc: lost.set_result((address, ids)))
        address = "tcp://127.0.0.1:9"  # nothing listens there
        pool.acquire(address)
        pool.send_soon(address, p.TokenDelta("a", (1,)))
        pool.send_soon(address, p.TokenDelta("b", (2,)))
        pool.send_soon(address, p.TokenDelta("a", (3,)))
        assert await asyncio.wait_for(lost, 10) == (address, ["a", "b"])
        await pool.close()

    asyncio.run(main())
