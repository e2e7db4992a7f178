"""Conditional disaggregation: when a prompt is prefilled by a decode because the prefills are backed up, and
the prompt queues it is decided by - counted while an instance works on a prompt, released when it answers
or fails."""
import asyncio

import pytest

from epdserve.services.proxy.failover import Failover
from epdserve.services.proxy.generation import GenerationError
from epdserve.services.proxy.prefill_queue import prefill_on_decode
from epdserve.services.proxy.router import Instance, RolePool, Route, Router
from epdserve.transport.channel.protocol import Ack, GenerateRequest, Role, WireSamplingParams
from epdserve.transport.channel.common import ChannelError


@pytest.mark.parametrize("prompt, prefills, decodes, local", [
    (128, [1024], [0], True),  # the prefill is backed up to the limit, the decode idle
    (128, [1023], [0], False),  # not yet at the limit
    (128, [2048, 512], [0], False),  # one prefill is not backed up: it takes the prompt
    (128, [1024], [896], True),  # the decode's queue with this prompt is no longer than the prefill's
    (128, [1024], [897], False),  # ... and now it would be
    (128, [1024], [2000, 0], True),  # one decode is free enough
    (1025, [4096], [0], False),  # a prompt over the limit always goes to prefill
    (128, [1 << 20], [0], True),
    (128, [], [0], False),  # no prefill instance: nothing backed up
])
def test_a_prompt_is_prefilled_by_a_decode_only_when_every_prefill_is_backed_up_and_a_decode_less(
        prompt, prefills, decodes, local):
    assert prefill_on_decode(prompt, prefills, decodes, limit=1024) is local


def test_a_limit_of_zero_never_prefills_on_a_decode():
    assert not prefill_on_decode(1, [1 << 30], [0], limit=0)


class GatedClient:
    """Answers once `gate` is set, or fails with `failure`."""

    def __init__(self, gate: asyncio.Event, failure: Exception | None = None) -> None:
        self.gate, self.failure = gate, failure
        self.num_disconnects = 0
        self.is_down = False

    async def request(self, message, *, timeout=None, expect=None):
        await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        return Ack(message.request_id)


@pytest.mark.parametrize("failure", [None, ChannelError("connection lost")])
def test_a_call_s_prompt_tokens_are_queued_at_its_instance_until_it_answers_or_fails(failure):
    async def scenario():
        gate = asyncio.Event()
        pool = RolePool(Role.PREFILL, [], make_client=None)
        instance = pool.instances["tcp://127.0.0.1:1"] = Instance(Role.PREFILL, "tcp://127.0.0.1:1",
                                                                  GatedClient(gate, failure), alive=True)
        failover = Failover(Router({Role.PREFILL: pool}), lambda instance, rid: None, max_attempts=1)
        request = GenerateRequest("r1", tuple(range(300)), WireSamplingParams(), "tcp://127.0.0.1:9")
        call = asyncio.ensure_future(failover.call(Role.PREFILL, Route(), request, 5.0, Ack, prompt_tokens=300))
        await asyncio.sleep(0.01)
        queued_while_working = (instance.inflight, instance.queued_prompt_tokens)
        gate.set()
        try:
            await call
        except GenerationError:
            assert failure is not None
        return queued_while_working, (instance.inflight, instance.queued_prompt_tokens)

    working, after = asyncio.run(scenario())
    assert working == (1, 300) and after == (0, 0)


def test_a_stream_s_prompt_leaves_the_queue_with_its_first_token_and_the_stream_at_its_end():
    instance = Instance(Role.DECODE, "tcp://127.0.0.1:1", client=None)
    instance.start(200)
    instance.prefilled(200)
    assert (instance.inflight, instance.queued_prompt_tokens) == (1, 0)
    instance.end(0)
    instance.start(50)
    instance.end(50)  # ended before its first token: nothing stays queued
    assert (instance.inflight, instance.queued_prompt_tokens) == (0, 0)
