"""The proxy's one failover path, on fake instances: which outcomes move on to the next instance, which
end the request at once, what gets aborted where, and how soon a dead instance is given up on."""
import asyncio
import time

import pytest

from epdserve.services.proxy.failover import (EmbeddingsUnavailable, Failover, InstanceDown, Liveness, service_error,
                                             watched)
from epdserve.services.proxy.generation import GenerationError
from epdserve.services.proxy.router import Instance, RolePool, Route, Router
from epdserve.transport.channel.protocol import Abort, Ack, Error, ErrorCode, GenerateRequest, Role, WireSamplingParams
from epdserve.transport.channel.common import ChannelError, ErrorReply


class FakeClient:
    """Answers each request with the next of `answers`: a message, an exception to raise, or "hang"."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.num_disconnects = 0
        self.is_down = False
        self.requests: list = []

    async def request(self, message, *, timeout=None, expect=None):
        self.requests.append(message)
        answer = self.answers.pop(0)
        if answer == "hang":
            await asyncio.sleep(timeout)
            raise TimeoutError("no answer")
        if isinstance(answer, BaseException):
            raise answer
        return answer


def make_failover(*clients: FakeClient, max_attempts: int = 3, reconnect_grace: float = 0.3):
    pool = RolePool(Role.DECODE, [], make_client=None)
    for i, client in enumerate(clients):
        pool.instances[f"tcp://127.0.0.1:{i + 1}"] = Instance(Role.DECODE, f"tcp://127.0.0.1:{i + 1}", client,
                                                              alive=True)
    aborted: list[tuple[str, str]] = []
    failover = Failover(Router({Role.DECODE: pool}), lambda instance, rid: aborted.append((instance.address, rid)),
                        max_attempts, liveness_check=0.05, reconnect_grace=reconnect_grace)
    return failover, list(pool.instances.values()), aborted


REQUEST = GenerateRequest("r1", (1, 2, 3), WireSamplingParams(), "tcp://127.0.0.1:9")


def refusal(code: ErrorCode, retryable: bool = False) -> ErrorReply:
    return ErrorReply(Error(code, "no", "r1", retryable))


def call(failover, timeout: float = 5.0):
    return asyncio.run(failover.call(Role.DECODE, Route(), REQUEST, timeout, Ack))


def test_a_retryable_refusal_moves_on_without_marking_the_instance():
    failover, (first, second), aborted = make_failover(FakeClient(refusal(ErrorCode.OVERLOADED, True)),
                                                       FakeClient(Ack("r1")))
    instance, answer = call(failover)
    assert answer == Ack("r1") and first.alive and not aborted
    assert {instance} == {second} and first.inflight == second.inflight == 0


def test_when_every_instance_refuses_for_load_the_503_says_when_to_retry():
    loaded = [ErrorReply(Error(ErrorCode.OVERLOADED, "queued", "r1", True, retry_after=wait)) for wait in (90.0, 75.0)]
    failover, instances, aborted = make_failover(*(FakeClient(error) for error in loaded))
    with pytest.raises(GenerationError, match="every decode instance tried failed") as raised:
        call(failover)
    assert raised.value.status == 503 and raised.value.retry_after == 75.0
    assert all(i.alive for i in instances) and not aborted


@pytest.mark.parametrize("error", [refusal(ErrorCode.BAD_REQUEST), refusal(ErrorCode.BAD_REQUEST, True),
                                   refusal(ErrorCode.INTERNAL)])
def test_a_refusal_the_request_may_have_caused_is_never_retried(error):
    second = FakeClient(Ack("r1"))
    failover, instances, aborted = make_failover(FakeClient(error), second)
    with pytest.raises(GenerationError) as raised:
        call(failover)
    assert raised.value.status == (400 if error.error.code == ErrorCode.BAD_REQUEST else 500)
    assert not second.requests and not aborted and all(i.alive for i in instances)


def test_embeddings_gone_with_their_encoder_are_the_request_s_to_encode_again_not_another_instance_s():
    """Every instance would fail alike (the embeddings are gone): the call ends at once with the typed error the
    request's lifecycle answers by encoding its images again; the instance stays routable."""
    second = FakeClient(Ack("r1"))
    failover, instances, aborted = make_failover(FakeClient(refusal(ErrorCode.EMBEDDINGS_UNAVAILABLE)), second)
    with pytest.raises(EmbeddingsUnavailable) as raised:
        call(failover)
    assert raised.value.status == 503 and raised.value.error_type == "ServiceUnavailableError"
    assert not second.requests and not aborted and all(i.alive for i in instances)


def test_a_stream_refused_for_load_after_its_ack_is_a_503_that_says_when_to_retry():
    """An engine whose adapter slots filled up between its first look and the request's start pushes a retryable
    refusal on the stream: the client's answer is the same 503 with Retry-After as a refusal before the Ack."""
    instance = Instance(Role.PREFILL, "tcp://127.0.0.1:1", FakeClient(), alive=True)
    error = service_error(Error(ErrorCode.OVERLOADED, "no room for LoRA adapter 'a'", "r1", retryable=True,
                                retry_after=1.0), instance)
    assert (error.status, error.error_type, error.retry_after) == (503, "ServiceUnavailableError", 1.0)
    assert "no room for LoRA adapter 'a'" in str(error)


def test_an_internal_error_of_a_dead_instance_moves_on():
    first = FakeClient(refusal(ErrorCode.INTERNAL))
    failover, (dead, _), _ = make_failover(first, FakeClient(Ack("r1")))

    async def request(message, **kwargs):
        dead.alive = False  # the instance went down while answering
        raise refusal(ErrorCode.INTERNAL)

    first.request = request
    assert call(failover)[1] == Ack("r1")


@pytest.mark.parametrize("failure", [ChannelError("connection lost"), "hang"])
def test_a_failure_marks_the_instance_aborts_there_and_moves_on(failure):
    failover, (first, second), aborted = make_failover(FakeClient(failure), FakeClient(Ack("r1")))
    instance, _ = call(failover, timeout=0.2)
    assert instance is second and not first.alive and aborted == [(first.address, "r1")]


def test_a_dead_instance_is_given_up_on_at_its_next_liveness_check():
    failover, (first, second), aborted = make_failover(FakeClient("hang"), FakeClient(Ack("r1")))

    async def main():
        task = asyncio.create_task(failover.call(Role.DECODE, Route(), REQUEST, 600, Ack))
        await asyncio.sleep(0.1)
        first.client.num_disconnects += 1  # its connection dropped: answers in flight are lost
        started = time.monotonic()
        instance, _ = await task
        return instance, time.monotonic() - started

    instance, waited = asyncio.run(main())
    assert instance is second and waited < 1 and aborted == [(first.address, "r1")]


def test_every_instance_failing_is_a_503_naming_the_last_failure():
    failover, instances, aborted = make_failover(*(FakeClient(ChannelError("gone")) for _ in range(4)))
    with pytest.raises(GenerationError, match="gone") as raised:
        call(failover)
    assert raised.value.status == 503 and len(aborted) == 3  # max_attempts
    with pytest.raises(GenerationError, match="no healthy decode") as raised:
        call(make_failover()[0])
    assert raised.value.status == 503


def test_an_instance_whose_connection_dropped_is_tried_again_once_back_after_its_abort_is_answered():
    # A stall past the heartbeats drops every connection at once: no other instance is left to try.
    client = FakeClient(ChannelError("connection lost"), Ack("r1"), Ack("r1"))
    failover, (only,), aborted = make_failover(client, reconnect_grace=30)

    async def main():
        async def polled_again():
            await asyncio.sleep(0.2)
            only.alive = True  # it answered a poll
        back = asyncio.create_task(polled_again())
        answer = await failover.call(Role.DECODE, Route(), REQUEST, 5.0, Ack)
        await back
        return answer

    instance, answer = asyncio.run(main())
    assert instance is only and answer == Ack("r1") and aborted == [(only.address, "r1")]
    assert client.requests == [REQUEST, Abort("r1"), REQUEST]  # sent again only once its abort was answered


@pytest.mark.parametrize("failure, grace", [(ChannelError("connection lost"), 0.5), ("hang", 60)])
def test_with_no_instance_back_the_call_ends_after_the_grace_and_a_hung_one_is_not_waited_for(failure, grace):
    failover, (only,), aborted = make_failover(FakeClient(failure), reconnect_grace=grace)
    started = time.monotonic()
    with pytest.raises(GenerationError, match="every decode instance tried failed") as raised:
        call(failover, timeout=0.2)
    waited = time.monotonic() - started
    assert raised.value.status == 503 and not only.alive and aborted == [(only.address, "r1")]
    # A dropped connection may come back within the grace; an instance that took too long is not waited for.
    assert waited >= grace if failure != "hang" else waited < grace / 2


def test_a_call_cancelled_while_an_instance_works_on_it_is_aborted_there():
    failover, (first,), aborted = make_failover(FakeClient("hang"))

    async def main():
        task = asyncio.create_task(failover.call(Role.DECODE, Route(), REQUEST, 600, Ack))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert aborted == [(first.address, "r1")] and first.alive and first.inflight == 0


def test_watched_times_out_and_notices_a_dead_instance():
    instance = Instance(Role.DECODE, "tcp://127.0.0.1:1", FakeClient(), alive=True)

    async def main():
        with pytest.raises(TimeoutError):
            await watched(asyncio.sleep(10), Liveness(instance), 0.02, timeout=0.1)
        liveness = Liveness(instance)
        instance.alive = False
        with pytest.raises(InstanceDown, match="stopped answering"):
            await watched(asyncio.sleep(10), liveness, 0.02)
        instance.alive = True
        assert await watched(asyncio.sleep(0, "done"), Liveness(instance), 0.02) == "done"

    asyncio.run(main())
