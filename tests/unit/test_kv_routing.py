"""The KV-aware choice: the instance that holds the prompt, unless its queue costs more than the prompt."""
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from epdserve.services.proxy.kv_routing import KVRoutingConfig, pick, rendezvous


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


def test_rendezvous_spreads_keys_evenly_over_a_large_fleet():
    fleet = [f"tcp://10.0.{i // 250}.{i % 250}:7000" for i in range(50)]
    wins = {a: 0 for a in fleet}
    for i in range(5000):
        wins[max(fleet, key=lambda a: rendezvous(f"prompt {i}".encode(), a))] += 1
    assert 50 <= min(wins.values()) and max(wins.values()) <= 150  # 100 each on average
    # Removing an instance moves only the keys it won.
    rest = fleet[1:]
    assert all(max(rest, key=lambda a: rendezvous(f"prompt {i}".encode(), a))
               == max(fleet, key=lambda a: rendezvous(f"prompt {i}".encode(), a))
               for i in range(500) if max(fleet, key=lambda a: rendezvous(f"prompt {i}".encode(), a)) != fleet[0])


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.sampled_from([None, 0, 2, 5, 8]),
                          st.booleans()), min_size=1, max_size=12),
       st.integers(0, 8), st.sampled_from([0.0, 0.25, 1.0]), st.sampled_from([0.0, 1.5]), st.binary(max_size=4))
def test_the_one_pass_picks_what_the_cost_order_says(fleet, prompt_blocks, load_weight, elsewhere, key):
    """Whatever loads, room and holdings: the lowest (no room, work) wins, and equal ones go by rendezvous."""
    candidates = [SimpleNamespace(address=f"i{n}", load=load,
                                  status=None if no_status else SimpleNamespace(num_free_blocks=free))
                  for n, (load, free, _, no_status) in enumerate(fleet)]
    cached = {f"i{n}": held for n, (_, _, held, _) in enumerate(fleet) if held is not None}

    def order(c):
        missing = prompt_blocks - cached.get(c.address, elsewhere)
        free = c.status.num_free_blocks if c.status else 0
        return free < missing, missing + load_weight * max(prompt_blocks, 1) * c.load

    lowest = min(map(order, candidates))
    expected = max((c for c in candidates if order(c) == lowest), key=lambda c: rendezvous(key, c.address))
    assert pick(candidates, cached, prompt_blocks, load_weight, key, elsewhere) == \
        (expected, cached.get(expected.address, elsewhere))


def test_config_refuses_negative_values():
    with pytest.raises(ValueError):
        KVRoutingConfig(load_weight=-1)
    with pytest.raises(ValueError):
        KVRoutingConfig(local_prefill_tokens=-1)
