"""The one failover path of the proxy: every call to a service (encode, prefill, start a stream) goes here.

Healthy instances are tried best first. While one works on the call, its liveness is watched (the
router's polls, the connection itself), so a dead instance fails over within seconds instead of at a
timeout. Each attempt ends in one of four outcomes:

- answered: the instance's answer is returned;
- refused, retryable (starting, draining, overloaded), or by an instance found dead: the next instance;
- refused for a reason the request itself may have caused (bad input; an internal error of an instance
  that is still alive): the client's error at once - retried, it could take every instance down in turn;
  or because the request's image embeddings are gone with their encoder: `EmbeddingsUnavailable`, which
  the request's lifecycle answers by encoding the images again (any instance of the role would fail alike);
- failed (instance dead, connection lost, no answer in time): the instance is marked failed, the call
  aborted there (it may have been accepted with only the answer lost), and the next instance tried.

A connection dropped without a dead peer (a stall past the heartbeats, on either side: every connection of a
stalled proxy drops at once; a restarted engine) comes back within a poll or two. So when no instance is left to
try and one was lost that way, the call waits up to `reconnect_grace` seconds for one of those to answer a
poll again, and tries it again (within `max_attempts`), once its abort of the earlier attempt has been answered:
the request id is free there again.

A call cancelled while an instance works on it (the client went away), or given up because the proxy's
drain grace ran out, is aborted on that instance too.
"""
from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Awaitable, Callable, TypeVar

from epdserve.services.proxy.generation import GenerationError
from epdserve.services.proxy.router import Instance, NoInstanceError, Route, Router
from epdserve.transport.channel.codec import LimitExceeded
from epdserve.transport.channel.protocol import Abort, Ack, Error, ErrorCode, Message, Role
from epdserve.transport.channel.common import ChannelError, ErrorReply

logger = logging.getLogger(__name__)
T = TypeVar("T")


class InstanceDown(ChannelError):
    """The instance working on a request was found dead while we waited for it."""


class EmbeddingsUnavailable(GenerationError):
    """An engine could not have the request's image embeddings from the encoder that made them (gone,
    unreachable): encoded again, the request may be sent once more. If it cannot, the client gets this error."""


def _never() -> None:
    pass


class Liveness:
    """Whether an instance has stayed up since this was made: the router still counts it alive and its
    connection never dropped (a dropped connection loses the answers in flight). `cut()` raises once
    the proxy stops waiting for anyone (its drain grace ran out)."""

    __slots__ = ("instance", "_disconnects", "_cut")

    def __init__(self, instance: Instance, cut: Callable[[], None] = _never) -> None:
        self.instance = instance
        self._disconnects = instance.client.num_disconnects
        self._cut = cut

    def check(self) -> None:
        """Raises InstanceDown if the instance went down, the cut's GenerationError after a cut."""
        self._cut()
        instance = self.instance
        client = instance.client
        if not instance.alive or client.is_down or client.num_disconnects != self._disconnects:
            raise InstanceDown(f"{instance.role.value} instance {instance.address} stopped answering")


async def watched(work: Awaitable[T], liveness: Liveness, interval: float, timeout: float | None = None) -> T:
    """`work`'s result, the instance's liveness checked every `interval` seconds meanwhile. Raises
    InstanceDown as soon as the instance is known dead, TimeoutError after `timeout` seconds (None: never);
    `work` is cancelled whenever this returns without its result (a cancelled caller included)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            liveness.check()
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"no answer from {liveness.instance.address} in {timeout:.0f}s")
    finally:
        task.cancel()


def service_error(error: Error, instance: Instance) -> GenerationError:
    """The client's error for an `Error` an instance answered (or pushed) for a request."""
    if error.code == ErrorCode.BAD_REQUEST:
        return GenerationError(error.message, 400, "BadRequestError")
    if error.code == ErrorCode.ABORTED:  # the instance stopped it: it is shutting down
        return GenerationError(f"{instance.role.value} {instance.address}: {error.message}", 503,
                               "ServiceUnavailableError")
    if error.code == ErrorCode.OVERLOADED:  # pushed on a stream that had no room after all: the client may retry
        return GenerationError(f"{instance.role.value} {instance.address}: {error.message}", 503,
                               "ServiceUnavailableError", retry_after=error.retry_after)
    if error.code == ErrorCode.EMBEDDINGS_UNAVAILABLE:
        return EmbeddingsUnavailable(f"{instance.role.value} {instance.address}: {error.message}", 503,
                                     "ServiceUnavailableError")
    return GenerationError(f"{instance.role.value} {instance.address}: {error.message}", 500)


class Outcome(enum.Enum):
    RETRY = "retry"  # another instance may answer: try the next one
    FINAL = "final"  # the request's own fault, or a live instance's: the client's error
    FAILED = "failed"  # the instance died, lost the connection or took too long: mark it, abort, next


def classify(exc: Exception, instance: Instance) -> Outcome:
    if isinstance(exc, ErrorReply):
        if exc.error.code != ErrorCode.BAD_REQUEST and (exc.error.retryable or not instance.alive):
            return Outcome.RETRY
        return Outcome.FINAL
    assert isinstance(exc, (ChannelError, TimeoutError))
    return Outcome.FAILED


class Failover:
    """Runs one call of a request on the instances of a role, best first, until one answers."""

    def __init__(self, router: Router, abort_soon: Callable[[Instance, str], None], max_attempts: int = 3,
                 liveness_check: float = 0.5, cut: Callable[[], None] = _never, reconnect_grace: float = 3.0) -> None:
        self.router = router
        self.cut = cut  # raises a GenerationError once the proxy stops waiting (see Liveness)
        self.abort_soon = abort_soon  # (instance, request id): abort there, without waiting
        self.max_attempts = max_attempts
        self.liveness_check = liveness_check  # seconds between two liveness checks of a waiting call
        self.reconnect_grace = reconnect_grace  # seconds a call waits for an instance whose connection dropped

    async def call(self, role: Role, route: Route, message: Message, timeout: float,
                   expect: type, prompt_tokens: int = 0) -> tuple[Instance, Any]:
        """(the instance that answered `message` with an `expect`, its answer), instances chosen by
        `route`. The instance counts the call in its load while working on it, and `prompt_tokens` (what
        the call asks it to prefill) in its prompt queue."""
        last: Exception | None = None
        retry_after: float | None = None  # the soonest any instance that refused for load may take it
        tried: list[Instance] = []  # not tried again
        dropped: list[Instance] = []  # lost their connection during an attempt: tried again once back
        for attempt in range(self.max_attempts):
            instance = await self._pick(role, route, tried, dropped)
            if instance is None:
                break
            try:
                if instance in dropped and instance.role != Role.ENCODER:  # the earlier attempt may run there
                    await instance.client.request(Abort(message.request_id), timeout=timeout, expect=Ack)
                return instance, await self._attempt(instance, message, timeout, expect, prompt_tokens)
            except LimitExceeded as exc:  # the request itself: no instance would take it
                raise GenerationError(f"the request is too large to forward: {exc}", 400, "BadRequestError") from None
            except (ChannelError, TimeoutError) as exc:
                outcome = classify(exc, instance)
                if outcome is Outcome.FINAL:
                    raise service_error(exc.error, instance) from None
                if outcome is Outcome.FAILED:
                    self.router.pool(role).mark_failed(instance)
                    self._abort_accepted(instance, message)
                elif exc.error.retry_after:
                    retry_after = min(retry_after or exc.error.retry_after, exc.error.retry_after)
                if outcome is Outcome.FAILED and not isinstance(exc, TimeoutError):
                    if instance not in dropped:
                        dropped.append(instance)
                else:
                    tried.append(instance)
                last = exc
            logger.warning("%s %s failed %s (attempt %d): %s", role.value, instance.address,
                           type(message).__name__, attempt + 1, last)
        what = f"no healthy {role.value} instance" if last is None else f"every {role.value} instance tried failed"
        raise GenerationError(what if last is None else f"{what}: {last}", 503, "ServiceUnavailableError",
                              retry_after)

    async def _pick(self, role: Role, route: Route, tried: list[Instance],
                    dropped: list[Instance]) -> Instance | None:
        """The best healthy instance not in `tried`; with none, and one of `dropped` not back yet (a dropped
        instance is routed to again once it answers a poll), within the reconnect grace. None: none left."""
        pool = self.router.pool(role)

        def best() -> Instance | None:
            try:
                return pool.pick(route, tried)
            except NoInstanceError:
                return None

        return await self.within_grace(best) if dropped else best()

    async def within_grace(self, found: Callable[[], T | None]) -> T | None:
        """`found()`'s first answer that is not None, asked again until the reconnect grace runs out (then None)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_grace
        while (answer := found()) is None and loop.time() < deadline:
            self.cut()
            await asyncio.sleep(0.1)
        return answer

    async def _attempt(self, instance: Instance, message: Message, timeout: float, expect: type,
                       prompt_tokens: int) -> Any:
        instance.start(prompt_tokens)
        try:
            call = instance.client.request(message, timeout=timeout, expect=expect)
            return await watched(call, Liveness(instance, self.cut), self.liveness_check)
        except (asyncio.CancelledError, GenerationError):  # the client went away, or the proxy's grace ran out
            self._abort_accepted(instance, message)
            raise
        finally:
            instance.end(prompt_tokens)

    def _abort_accepted(self, instance: Instance, message: Message) -> None:
        # Encoders keep nothing per request: an encode that was accepted just fills their cache.
        if instance.role != Role.ENCODER:
            self.abort_soon(instance, message.request_id)
