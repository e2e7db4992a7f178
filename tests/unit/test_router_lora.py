"""The router prefers, for a LoRA adapter's request, the instances that have read the adapter; with none
that has, any instance (it reads the adapter on first use); load still decides among those that have."""
from types import SimpleNamespace

from epdserve.services.proxy.router import Instance, RolePool, Route
from epdserve.transport.channel.protocol import Health, Role, Status


def pool_of(*instances: tuple[str, tuple[str, ...], int]) -> RolePool:
    """Instances (address, adapters read, requests running), each alive and reachable."""
    pool = RolePool(Role.UNIFIED, [], make_client=None)
    for address, adapters, running in instances:
        status = Status(address, Role.UNIFIED, Health.READY, 100, 100, running, 0, lora_adapters=adapters, max_loras=4)
        pool.instances[address] = Instance(Role.UNIFIED, address, SimpleNamespace(is_down=False), status, alive=True)
    return pool


def test_an_adapters_request_goes_where_the_adapter_was_read():
    pool = pool_of(("a", (), 0), ("b", ("sql",), 5), ("c", ("chat",), 0))
    assert pool.pick(Route(lora="sql")).address == "b"  # though the busiest
    assert pool.pick(Route(key=b"prompt", lora="sql")).address == "b"
    assert pool.pick(Route(lora="chat")).address == "c"


def test_load_decides_among_the_holders_and_anyone_serves_an_adapter_nobody_read():
    pool = pool_of(("a", ("sql",), 3), ("b", ("sql",), 1), ("c", (), 0))
    assert pool.pick(Route(lora="sql")).address == "b"
    assert pool.pick(Route(lora="new")).address == "c"  # least loaded of all
    assert pool.pick(Route()).address == "c"
    # The holder excluded (it failed): another instance takes it.
    assert pool.pick(Route(lora="sql"), exclude=[pool.instances["a"], pool.instances["b"]]).address == "c"
