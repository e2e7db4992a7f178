"""`AsyncLLM`: the engine loop on its own thread, requests as async iterators of incremental outputs.

The engine is touched only by its thread: callers hand it additions and aborts through a queue, and get
outputs back on their event loop. torch releases the GIL inside its kernels, so the event loop stays
responsive while a step runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from epdserve.shared.engine.compute_threads import set_this_thread
from epdserve.shared.engine.default_logging import use_default_logging
from epdserve.shared.engine.llm_engine import LLMEngine, PromptType
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.outputs import RequestOutput
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import RemoteKVReservation

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can run on this engine any more."""


class RequestFailedError(RuntimeError):
    """This request failed in the engine (the engine itself goes on). A request that failed by its own
    doing (its structured output allows no token) raises ValueError instead, as bad input does."""


class _Stream:
    """Where one request's outputs land, on the caller's event loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], num_threads: int | None = None) -> None:
        """`engine`, or a function that builds it, which then runs on the engine's thread. `num_threads`: the
        engine thread's compute threads (None: the process-wide setting). A service builds its engine on
        the engine thread with the cores, every other thread single-threaded: see `compute_threads`."""
        self._commands: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        # Held while checking `_dead` and queueing, and while the dying loop drains the queue: no call
        # can slip into the queue after the drain and wait forever.
        self._lock = threading.Lock()
        self._on_dead: list[Callable[[BaseException], None]] = []
        self._stopping = False
        # Engine thread only: reservations waiting for room, in arrival order, and whether room freed up
        # since they were last tried.
        self._reservations: list[tuple[Request, concurrent.futures.Future]] = []
        self._room = False
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._start, args=(engine, num_threads, built), name="epdserve-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()  # raises what building it raised

    @classmethod
    def from_model(cls, model: str, **kwargs) -> AsyncLLM:
        """Build the engine like `LLM(model, **kwargs)` does, on the engine's thread."""
        use_default_logging()
        config = build_engine_config(model, **kwargs)
        return cls(lambda: LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def make_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                           request_id: str | None = None, **kwargs) -> Request:
        """Validate, tokenize and compile the output constraint (raises ValueError); touches no engine
        state. The compile, which can take seconds for a large grammar, runs off the caller's event loop
        and gets `EngineConfig.grammar_compile_timeout` seconds (then the request is refused)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        constraint = sampling_params.structured_outputs if sampling_params is not None else None
        compiled = None
        if constraint is not None and self.engine.grammar_compiler is not None:
            timeout = self.engine.config.grammar_compile_timeout
            try:
                compiled = await asyncio.wait_for(
                    asyncio.wrap_future(self.engine.grammar_compiler.compile_soon(constraint)), timeout)
            except TimeoutError:
                raise ValueError(f"the structured output took longer than {timeout:g}s to compile "
                                 "(--grammar-compile-timeout); simplify it") from None
        return self.engine.make_request(request_id, prompt, sampling_params, compiled_grammar=compiled, **kwargs)

    async def generate(self, prompt: PromptType | Request, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the request progresses (by its `output_kind`); the last one has finished=True.
        With n > 1, outputs of the n sequences interleave (each completion has its `index`); the request
        has finished when all have.

        Leaving the iteration early (break, cancellation, client gone) aborts the request.
        """
        request = prompt if isinstance(prompt, Request) else await self.make_request(prompt, sampling_params,
                                                                                     request_id, **kwargs)
        stream = self._open_stream(request.group_id)
        with self._lock:
            self.engine.queue_estimate.submitted_tokens += request.num_prompt_tokens
        self._put(("add", request))
        async for out in self._drain(request.group_id, stream):
            yield out

    async def generate_prefilled(self, request: Request, first_token_ids: int | Sequence[int],
                                 fill_kv: Callable[[RemoteKVReservation], Awaitable[None]],
                                 wait_timeout: float = 30.0) -> AsyncIterator[RequestOutput]:
        """Continue a request whose prompt a peer engine computed: reserve blocks (waiting up to
        `wait_timeout` seconds for room), let `fill_kv` write the missing ones into `engine.runner.kv_cache`,
        then decode from the first token (one per sequence when n > 1: the sequences fork from the one
        set of blocks). Yields outputs like `generate`, without the first tokens."""
        stream = self._open_stream(request.group_id)
        try:
            await fill_kv(await self._reserve(request, wait_timeout))
        except BaseException:
            self._streams.pop(request.group_id, None)
            self._commands.put(("abort", request.group_id))
            raise
        self._put(("add_prefilled", (request, first_token_ids)))
        async for out in self._drain(request.group_id, stream):
            yield out

    async def _reserve(self, request: Request, wait_timeout: float) -> RemoteKVReservation:
        """Blocks for the request's prompt, reserved as soon as the engine has room: it retries waiting
        reservations when blocks free up, in arrival order. A caller that gives up must abort the request
        (it may have got its blocks meanwhile)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("reserve", (request, future)))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), wait_timeout)
        except TimeoutError:
            raise TimeoutError(f"no KV blocks free for request {request.group_id} after {wait_timeout}s") from None

    async def generate_recomputed(self, request: Request,
                                  first_token_ids: int | Sequence[int]) -> AsyncIterator[RequestOutput]:
        """Continue a request whose first token(s) a peer sampled when its KV cannot be had: recompute the
        prompt and that token here, then decode. Yields outputs like `generate_prefilled`."""
        stream = self._open_stream(request.group_id)
        self._put(("add_recomputed", (request, first_token_ids)))
        async for out in self._drain(request.group_id, stream):
            yield out

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread, between steps, and return its result. Cancelling the
        await before the engine thread took the call means it never runs."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    def call_soon(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run `fn(engine)` on the engine thread at its next step boundary, without waiting for it."""
        self._put(("call", (fn, concurrent.futures.Future())))

    def queue_seconds(self) -> float:
        """About how long a request arriving now would wait for its prompt to start (see QueueEstimate);
        any thread may ask."""
        return self.engine.queue_estimate.seconds

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, or None while it runs."""
        return self._dead

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Have `callback(cause)` called (on the engine thread) if the engine loop dies."""
        self._on_dead.append(callback)

    def _put(self, command: tuple[str, object]) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError("the engine loop has stopped") from self._dead
            self._commands.put(command)

    def _open_stream(self, request_id: str) -> _Stream:
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # opened before the loop dies (and then told so), or refused
            if self._dead is not None:
                raise EngineDeadError("the engine loop has stopped") from self._dead
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        return stream

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # -- engine thread ------------------------------------------------------------------------------
    def _start(self, engine: LLMEngine | Callable[[], LLMEngine], num_threads: int | None,
               built: concurrent.futures.Future) -> None:
        if num_threads is not None:
            set_this_thread(num_threads)
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(self.engine)
        self.engine.scheduler.on_room = self._note_room
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                # Block for work only when a step would compute nothing (a request whose KV is still on its
                # way from a peer must not make the loop spin and starve the thread receiving that KV).
                self._apply(self._commands.get() if not self.engine.has_work() else None)
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                self._retry_reservations()
                if self.engine.has_work():
                    outputs = self.engine.step()
                    with self.engine.step_timer.phase("output"):
                        self._deliver(outputs)
                    self._retry_reservations()
        except BaseException as exc:  # the loop must not die silently with requests waiting on it
            logger.exception("engine loop failed")
            self._die(exc)

    def _die(self, cause: BaseException) -> None:
        with self._lock:
            self._dead = cause
            error = EngineDeadError(f"engine loop failed: {cause!r}")
            while True:  # calls still queued would wait forever
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind in ("call", "reserve") and arg[1].set_running_or_notify_cancel():
                    arg[1].set_exception(error)
            for _, future in self._reservations:
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)
            self._reservations.clear()
        for callback in self._on_dead:  # before the waiters hear of it: by then the service says unhealthy
            callback(cause)
        for stream in list(self._streams.values()):  # no stream opens once `_dead` is set
            stream.put(error)

    def _apply(self, command: tuple[str, object] | None) -> None:
        if command is None:
            return
        kind, arg = command
        if kind == "call":
            fn, future = arg
            if not future.set_running_or_notify_cancel():
                return  # its caller gave up waiting (cancelled) before it ran
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # the caller gets it; the engine loop goes on
                future.set_exception(exc)
            return
        if kind == "abort":
            # Before any later command with the same id (a recomputation): a reservation still waiting
            # would otherwise take blocks for it.
            self._reservations = [(r, f) for r, f in self._reservations if r.group_id != arg]
            self._deliver(self.engine.abort_request(arg))
            return
        if kind == "reserve":
            self._reservations.append(arg)
            self._room = True  # tried at once
            return
        if kind == "stop":
            return  # `_stopping` ends the loop
        request, first_token_id = (arg, None) if kind == "add" else arg
        try:
            if kind == "add":
                with self._lock:
                    self.engine.queue_estimate.submitted_tokens -= request.num_prompt_tokens
                self.engine.add_request(request.request_id, request)
            elif kind == "add_prefilled":
                self._deliver(self.engine.add_prefilled(request, first_token_id))
            else:
                self._deliver(self.engine.add_recomputed(request, first_token_id))
        except Exception as exc:  # this request's failure, not the engine's
            stream = self._streams.pop(request.group_id, None)  # it hears of the failure, not of the abort
            if stream is not None:
                stream.put(exc)
            if not isinstance(exc, ValueError):  # a ValueError is bad input and added nothing
                logger.exception("request %s could not be added", request.group_id)
                self.engine.abort_request(request.group_id)

    def _note_room(self) -> None:
        self._room = True

    def _retry_reservations(self) -> None:
        """Give the room that freed up to the reservations waiting for it, in arrival order (one that does
        not fit lets a later, smaller one try)."""
        if not self._room:
            return
        self._room = False
        waiting, self._reservations = self._reservations, []
        for request, future in waiting:
            if future.cancelled():
                continue  # its caller gave up before it got blocks
            try:
                reservation = self.engine.reserve_remote_kv(request)
            except Exception as exc:  # bad input (too long for the pool, id in use): the caller's error
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                continue
            if reservation is None:
                self._reservations.append((request, future))
            elif future.set_running_or_notify_cancel():
                future.set_result(reservation)
            # else its caller gave up just now: the abort it sends frees the blocks

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each streams' event loop per step, not one
        per request (each wake-up takes the GIL from this thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                item = out if out.error is None else (ValueError if out.bad_input else RequestFailedError)(out.error)
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            if not loop.is_closed():  # a caller's loop that ended has nobody left to tell
                loop.call_soon_threadsafe(_put_all, items)
