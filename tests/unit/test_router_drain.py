"""The router while instances drain or vanish: a DRAINING instance is alive (its streams go on) but takes
nothing new; one that DNS stops naming is watched for as long as this proxy has requests there, so a
stream on it ends when it dies instead of waiting on an address nobody polls."""
import asyncio
import socket

import pytest

from epdserve.services.proxy.failover import InstanceDown, Liveness
from epdserve.services.proxy.router import RolePool
from epdserve.transport.channel.common import ChannelError
from epdserve.transport.channel.protocol import Health, Role, Status


class StatusClient:
    """A control client whose polls answer with `health`, or fail once `gone` is set."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.health = Health.READY
        self.gone = False
        self.closed = False
        self.num_disconnects = 0
        self.is_down = False

    async def request(self, message, *, timeout=None, expect=None):
        if self.gone:
            raise ChannelError(f"{self.address}: connection refused")
        return Status(self.address, Role.DECODE, self.health, 100, 100, 0, 0)

    async def close(self) -> None:
        self.closed = True


class Dns:
    """getaddrinfo for one name, answering whichever IPs the test says the name has now."""

    def __init__(self) -> None:
        self.ips = ["10.0.0.1", "10.0.0.2"]

    async def getaddrinfo(self, host, port, **kwargs):
        if not self.ips:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in self.ips]


def make_pool(monkeypatch) -> tuple[RolePool, Dns, dict[str, StatusClient]]:
    dns, clients = Dns(), {}

    def make_client(address, role):
        clients[address] = StatusClient(address)
        return clients[address]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", dns.getaddrinfo)
    return RolePool(Role.DECODE, ["decode:7000"], make_client), dns, clients


FIRST, SECOND = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"


async def refreshed(pool: RolePool) -> None:
    await pool.resolve()
    await pool.poll()


def test_a_draining_instance_keeps_its_streams_and_takes_nothing_new(monkeypatch):
    async def main():
        pool, _, clients = make_pool(monkeypatch)
        await refreshed(pool)
        assert {i.address for i in pool.healthy()} == {FIRST, SECOND}
        first = pool.instances[FIRST]
        liveness = Liveness(first)  # a stream on the first instance
        clients[FIRST].health = Health.DRAINING
        await pool.poll()
        assert [i.address for i in pool.healthy()] == [SECOND] and pool.pick_least_loaded().address == SECOND
        assert first.alive and not first.routable
        liveness.check()  # the stream goes on
        clients[FIRST].health = Health.READY  # a drain that was called off
        await pool.poll()
        assert first.routable

    asyncio.run(main())


def test_an_instance_gone_from_dns_is_watched_until_its_streams_end(monkeypatch):
    async def main():
        pool, dns, clients = make_pool(monkeypatch)
        await refreshed(pool)
        first, second = pool.instances[FIRST], pool.instances[SECOND]
        first.inflight = 1  # a stream of this proxy runs there
        dns.ips = []  # both pods turned unready: the headless Service names neither
        await refreshed(pool)
        assert not pool.healthy() and pool.retiring == {FIRST: first}
        assert clients[SECOND].closed and not second.alive  # nothing of ours there: closed at once
        liveness = Liveness(first)
        liveness.check()  # still answering: the stream goes on
        clients[FIRST].gone = True  # then the process is gone for good
        clients[FIRST].num_disconnects += 1
        await pool.poll()
        with pytest.raises(InstanceDown):
            liveness.check()  # the stream ends with an error now, not at a token timeout
        assert not pool.retiring and clients[FIRST].closed

    asyncio.run(main())


def test_a_watched_instance_is_let_go_once_its_streams_end_and_taken_back_if_dns_names_it(monkeypatch):
    async def main():
        pool, dns, clients = make_pool(monkeypatch)
        await refreshed(pool)
        first = pool.instances[FIRST]
        first.inflight = 1
        dns.ips = ["10.0.0.2"]
        await refreshed(pool)
        assert pool.retiring == {FIRST: first} and [i.address for i in pool.healthy()] == [SECOND]
        dns.ips = ["10.0.0.1", "10.0.0.2"]  # ready again before its stream ended: the same instance
        await refreshed(pool)
        assert pool.instances[FIRST] is first and first.routable and not pool.retiring
        dns.ips = ["10.0.0.2"]
        await refreshed(pool)
        first.inflight = 0  # its stream ended
        await pool.poll()
        assert not pool.retiring and clients[FIRST].closed and FIRST not in pool.instances

    asyncio.run(main())
