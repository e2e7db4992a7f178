"""The KV-aware choice: the instance that holds the prompt, unless its queue costs more than the prompt."""
from types import SimpleNamespace

import pytest

from epdserve.services.proxy.kv_routing import KVRoutingConfig, pick


def instance(name: str, load: int = 0, free: int = 1000):
    return SimpleNamespace(address=name, load=load, status=SimpleNamespace(num_free_blocks=free))


def test_the_holder_wins_until_its_queue_costs_more_than_the_prompt():
    a, b = instance("a", load=2), instance("b", load=0)
    assert pick([a, b], {"a": 20}, 20, 0.25) == (a, 20)  # 0 + 0.25*20*2 = 10 < 20
    a.load = 5
    assert pick([a, b], {"a": 20}, 20, 0.25) == (b, 0)  # 25 > 20
    assert pick([a, b], {"a": 20}, 20, 0.0) == (a, 20)  # load ignored


def test_an_instance_without_room_for_what_it_lacks_comes_last():
    full, roomy = instance("full", free=3), instance("roomy", load=9)
    assert pick([full, roomy], {}, 10, 0.25)[0] is roomy
    assert pick([full, roomy], {"full": 8}, 10, 0.25)[0] is full  # it lacks 2 blocks and has room for 3


def test_ties_go_by_the_prompt_head_so_distinct_prompts_spread_and_equal_ones_meet():
    fleet = [instance(f"tcp://10.0.0.{i}:7000") for i in range(4)]
    chosen = {pick(fleet, {}, 0, 0.25, key=f"prompt {i}".encode())[0].address for i in range(40)}
    assert len(chosen) == 4
    again = [pick(fleet, {}, 0, 0.25, key=b"same head")[0] for _ in range(5)]
    assert all(c is again[0] for c in again)


def test_config_refuses_negative_values():
    with pytest.raises(ValueError):
        KVRoutingConfig(load_weight=-1)
    with pytest.raises(ValueError):
        KVRoutingConfig(local_prefill_tokens=-1)
