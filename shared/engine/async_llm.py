"""`AsyncLLM`: the engine loop on its own thread, requests as async iterators of incremental outputs.

The engine is touched only by its thread: every call that reads or changes engine state hands it a typed
command (engine_commands.py) through a queue - answered ones (`Question`) through a future - and callers
get outputs back on their event loop. What any thread may read besides is set once at start (the tokenizer,
the KV cache, the config) or a snapshot the engine's thread publishes (stats, the adapters' names, the
connectors, the queue estimate - to which a submit adds its prompt under `_lock` before the engine takes it
in, so that admission control counts a burst at once); `make_request` is a pure constructor over those
(and the thread-safe grammar compiler). torch releases the GIL inside its kernels, so the event loop stays
responsive while a step runs. Everything a service needs of its engine is a method here; nothing outside
the engine reaches its scheduler, runner or cache objects.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable

import torch

from epdserve.shared.config import EngineConfig
from epdserve.shared.compute_threads import set_this_thread
from epdserve.shared.engine.default_logging import use_default_logging
from epdserve.shared.engine.engine_commands import (Abort, AddConnector, CanSeatLoRA, Command, Expect, FindLoRA,
                                                    FinishLoad, LoadLoRA, OnStep, Question, ReleaseKV, Stop, Submit,
                                                    TakeKVEvents, UnloadLoRA)
from epdserve.shared.engine.kv_connector import KVConnector, tier_stats
from epdserve.shared.engine.kv_events import KVEventBatch
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.llm_engine import LLMEngine, PromptType
from epdserve.shared.engine.lora_manager import LoRAAdapter, NoLoRASlotError
from epdserve.shared.engine.lora_request import LoRARequest
from epdserve.shared.engine.outputs import EngineStats, RequestOutput
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can run on this engine any more."""


class RequestFailedError(RuntimeError):
    """This request failed in the engine (the engine itself goes on). A request that failed by its own
    doing (its structured output allows no token) raises ValueError instead, as bad input does."""


class InputsUnavailableError(RequestFailedError):
    """This request's inputs that a connector was to supply (image embeddings) could not be had where they were
    said to be: their source is gone. Made again elsewhere, the same request may succeed."""


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
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        # Ids whose stream closed before their request ended, with how many of those aborts are still queued:
        # until the engine has applied them, its outputs for such an id are that request's, never those of a
        # request that took the id again meanwhile (queued after the abort, it has made none yet). Under `_lock`,
        # with the lookup of the streams a step's outputs go to.
        self._closed: dict[str, int] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        # Held while checking `_dead` and queueing, and while the dying loop drains the queue: no call
        # can slip into the queue after the drain and wait forever.
        self._lock = threading.Lock()
        self._on_dead: list[Callable[[BaseException], None]] = []
        self._stopping = False
        # The engine thread's snapshots, each published before any caller can see what changed it: the
        # adapters' names and the connectors (`_start`, then as they change), the stats (after each step).
        self._lora_names: tuple[str, ...] = ()
        self._connectors: tuple[KVConnector, ...] = ()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._start, args=(engine, num_threads, built), name="epdserve-engine",
                                        daemon=True)
        self._thread.start()
        self._engine: LLMEngine = built.result()  # raises what building it raised
        self._stats: EngineStats = self._engine.stats()

    @classmethod
    def from_model(cls, model: str, **kwargs) -> AsyncLLM:
        """Build the engine like `LLM(model, **kwargs)` does, on the engine's thread."""
        use_default_logging()
        return cls.from_config(build_engine_config(model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, detokenize: bool = True, num_threads: int | None = None) -> AsyncLLM:
        """An engine built from `config` on its own thread (`detokenize=False`: outputs carry token ids only,
        for a service whose proxy makes the text)."""
        return cls(lambda: LLMEngine(config, detokenize=detokenize), num_threads)

    # -- what any thread may read: set once at start, or snapshots ---------------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV cache's memory, [num_layers, 2, num_blocks, ...] (transports register and fill it)."""
        return self._engine.runner.kv_cache

    def stats(self) -> EngineStats:
        """The engine's state after its latest step (a snapshot the engine's thread publishes), with each KV
        connector's counters as of now (`KVConnector.stats`, which any thread may call: a tier's saves and
        a store's puts go on while the engine idles)."""
        return self._stats._replace(kv_tiers=tier_stats(self._connectors))

    def queue_seconds(self) -> float:
        """About how long a request arriving now would wait for its prompt to start (see QueueEstimate)."""
        return self._engine.queue_estimate.seconds

    # -- requests -----------------------------------------------------------------------------------
    async def make_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                           request_id: str | None = None, lora_request: LoRARequest | None = None,
                           **kwargs) -> Request:
        """Validate, tokenize and compile the output constraint (raises ValueError). Keyword arguments are
        `LLMEngine.make_request`'s. The compile, which can take seconds for a large grammar, runs off the
        caller's event loop and gets `EngineConfig.grammar_compile_timeout` seconds (then the request is
        refused).

        A pure constructor, on the caller's thread: it reads only what is set once at start (the tokenizer,
        the model's and the engine's config) and the grammar compiler, which is thread-safe and made for
        this - no command needed, and a request refused here never reaches the engine's queue. The one
        piece of engine state a request needs, its LoRA adapter, is had through typed commands first
        (`load_lora`'s: found, or read off both threads and then kept)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        constraint = sampling_params.structured_outputs if sampling_params is not None else None
        compiler = self._engine.grammar_compiler
        compiled = None
        if constraint is not None and compiler is not None:
            timeout = self._engine.config.grammar_compile_timeout
            try:
                compiled = await asyncio.wait_for(asyncio.wrap_future(compiler.compile_soon(constraint)), timeout)
            except TimeoutError:
                raise ValueError(f"the structured output took longer than {timeout:g}s to compile "
                                 "(--grammar-compile-timeout); simplify it") from None
        adapter = None if lora_request is None else await self._lora_adapter(lora_request)
        return self._engine.make_request(request_id, prompt, sampling_params, compiled_grammar=compiled,
                                         lora_adapter=adapter, **kwargs)

    async def generate(self, prompt: PromptType | Request, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the request progresses (by its `output_kind`); the last one has finished=True.
        With n > 1, outputs of the n sequences interleave (each completion has its `index`); the request
        has finished when all have. A request that continues from tokens a peer sampled (`make_request`'s
        `peer_token_ids`) yields only what follows them.

        Leaving the iteration early (break, cancellation, client gone) aborts the request.
        """
        request = prompt if isinstance(prompt, Request) else await self.make_request(prompt, sampling_params,
                                                                                     request_id, **kwargs)
        stream = self._open_stream(request.group_id)
        with self._lock:
            self._engine.queue_estimate.submitted_tokens += request.num_prompt_tokens
        self._put(Submit(request))
        # Closed with this generator, not when the collector gets to it: the abort is queued, and the id free, by
        # the time a caller's aclose() returns.
        async with contextlib.aclosing(self._drain(request.group_id, stream)) as outputs:
            async for out in outputs:
                yield out

    # -- LoRA adapters ------------------------------------------------------------------------------
    async def load_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter (LoRAAdapterError, a ValueError, if it cannot be served) unless the
        engine keeps it already (`FindLoRA`), then have the engine keep it (`LoadLoRA`); the reading runs
        off the event loop and off the engine's steps."""
        await self._lora_adapter(lora_request)

    async def _lora_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        self._engine.check_lora_request(lora_request)  # config only: bad input raises before any command
        adapter = await self._ask(FindLoRA(lora_request))
        if adapter is None:
            adapter = await asyncio.to_thread(self._engine.read_lora, lora_request)
            adapter = await self._ask(LoadLoRA(adapter))
        return adapter

    async def unload_lora(self, name: str) -> bool:
        """Forget adapter `name` (False if it was not kept): requests added already finish with it."""
        return await self._ask(UnloadLoRA(name))

    def lora_adapters(self) -> list[str]:
        """The adapters kept, by name (any thread: a snapshot the engine's thread publishes as they change)."""
        return list(self._lora_names)

    async def can_seat_lora(self, name: str) -> bool:
        """Whether a request with adapter `name` would find it a slot now."""
        return await self._ask(CanSeatLoRA(name))

    async def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    def release_kv(self, request_id: str) -> None:
        """Free, at the next step boundary, the blocks a KV connector kept for a finished request."""
        self._put(ReleaseKV(request_id))

    # -- KV from elsewhere, and what routers and metrics follow --------------------------------------
    def add_connector(self, connector: KVConnector) -> None:
        """Let `connector` feed this engine's requests and keep finished ones' KV (kv_connector.py), asked after
        those added before it; its loads may end, and what it kept go, on any thread. `close()` closes it."""
        self._put(AddConnector(connector, lambda result: self._put(FinishLoad(result)), self.release_kv))

    def expect(self, request_id: str, kv_transfer_params: object) -> None:
        """Tell the KV connectors that request `request_id`, with these `kv_transfer_params`, is about to be
        submitted (`KVConnector.expect`), ahead of its submit. Queued without a check: on an engine whose
        loop died, the request's submit says so."""
        self._commands.put(Expect(request_id, kv_transfer_params))

    async def kv_events(self, next_seq: int | None) -> KVEventBatch:
        """What the prefix cache stored and evicted since event batch `next_seq` (see LLMEngine.kv_events)."""
        return await self._ask(TakeKVEvents(next_seq))

    def on_step(self, callback: Callable[[int], None]) -> None:
        """Have `callback(num_tokens)` called on the engine's thread with the tokens each step computes."""
        self._put(OnStep(callback))

    async def _ask(self, question: Question):
        """`question`'s answer from the engine thread, between steps. Cancelled before it was applied, it never
        is."""
        self._put(question)
        return await asyncio.wrap_future(question.future)

    # -- the loop's lifetime ------------------------------------------------------------------------
    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, or None while it runs."""
        return self._dead

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Have `callback(cause)` called (on the engine thread) if the engine loop dies."""
        self._on_dead.append(callback)

    def shutdown(self) -> None:
        """Stop the engine loop, then shut the KV connectors' threads down (`LLMEngine.close`)."""
        self._stopping = True
        self._commands.put(Stop())
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._engine.close()

    async def close(self) -> None:
        """`shutdown()`, then close every KV connector in order (`KVConnector.close`) on this event loop: what
        they run on it, tasks and connections, ends with them."""
        self.shutdown()
        for connector in self._connectors:
            await connector.close()

    def _put(self, command: Command) -> None:
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
            with self._lock:
                if not finished:
                    self._closed[request_id] = self._closed.get(request_id, 0) + 1
                    self._commands.put(Abort(request_id, to_stream=False))
                self._streams.pop(request_id, None)

    # -- engine thread ------------------------------------------------------------------------------
    def _start(self, engine: LLMEngine | Callable[[], LLMEngine], num_threads: int | None,
               built: concurrent.futures.Future) -> None:
        if num_threads is not None:
            set_this_thread(num_threads)
        try:
            self._engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as exc:
            built.set_exception(exc)
            return
        # Its own tier, first in its connectors: it offers its blocks before a peer's connector is asked.
        self._engine.bind_connectors(lambda result: self._put(FinishLoad(result)), self.release_kv)
        self._lora_names = tuple(self._engine.lora_adapters())
        self._connectors = tuple(self._engine.connectors)
        built.set_result(self._engine)
        self._run()

    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stopping:
                # Block for work only when a step would compute nothing (a request whose KV is still on its
                # way from a peer must not make the loop spin and starve the thread receiving that KV).
                self._apply(self._commands.get() if not engine.has_work() else None)
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if engine.has_work():
                    outputs = engine.step()
                    self._stats = engine.stats()  # before the outputs: whoever sees them sees this step's state
                    with engine.step_timer.phase("output"):
                        self._deliver(outputs)
                else:
                    self._stats = engine.stats()
        except BaseException as exc:  # the loop must not die silently with requests waiting on it
            logger.exception("engine loop failed")
            self._die(exc)

    def _die(self, cause: BaseException) -> None:
        with self._lock:
            self._dead = cause
            error = EngineDeadError(f"engine loop failed: {cause!r}")
            while True:  # queries still queued would wait forever
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, Question) and command.future.set_running_or_notify_cancel():
                    command.future.set_exception(error)
        for callback in self._on_dead:  # before the waiters hear of it: by then the service says unhealthy
            callback(cause)
        for stream in list(self._streams.values()):  # no stream opens once `_dead` is set
            stream.put(error)

    def _apply(self, command: Command | None) -> None:
        engine = self._engine
        match command:
            case None | Stop():
                pass  # `_stopping` ends the loop
            case Submit(request=request):
                with self._lock:
                    engine.queue_estimate.submitted_tokens -= request.num_prompt_tokens
                try:
                    engine.add_request(request.request_id, request)
                except Exception as exc:  # this request's failure, not the engine's
                    stream = self._streams.pop(request.group_id, None)  # it hears of this, not of the abort
                    if stream is not None:
                        stream.put(exc)
                    # A ValueError is bad input, a NoLoRASlotError a full engine (retryable): neither added
                    # anything, and neither is a fault worth a traceback.
                    if not isinstance(exc, (ValueError, NoLoRASlotError)):
                        logger.exception("request %s could not be added", request.group_id)
                        engine.abort_request(request.group_id)
            case Abort(request_id=request_id, to_stream=True):
                self._deliver(engine.abort_request(request_id))
            case Abort(request_id=request_id):  # its stream closed: nobody hears of its end
                engine.abort_request(request_id)
                with self._lock:
                    if self._closed[request_id] == 1:
                        del self._closed[request_id]
                    else:
                        self._closed[request_id] -= 1
            case ReleaseKV(request_id=request_id):
                engine.release_kv(request_id)
            case FinishLoad(result=result):
                self._deliver(engine.finish_load(result))
            case AddConnector(connector=connector, finish=finish, release=release):
                engine.add_connector(connector, finish, release)
                self._connectors = tuple(engine.connectors)
            case Expect(request_id=request_id, kv_transfer_params=params):
                engine.expect(request_id, params)
            case OnStep(callback=callback):
                engine.on_step_tokens = callback
            case Question(future=future):
                if future.set_running_or_notify_cancel():  # else its caller gave up before it was applied
                    try:
                        future.set_result(self._answer(command))
                    except Exception as exc:  # the caller gets it; the engine loop goes on
                        future.set_exception(exc)

    def _answer(self, question: Question):
        """What the engine says to `question` (on its thread); what it changes is published before the answer."""
        engine = self._engine
        match question:
            case TakeKVEvents(next_seq=next_seq):
                return engine.kv_events(next_seq)
            case FindLoRA(lora_request=lora_request):
                return engine.find_lora(lora_request)
            case LoadLoRA(adapter=adapter):
                adapter = engine.add_lora(adapter)
                self._lora_names = tuple(engine.lora_adapters())
                return adapter
            case UnloadLoRA(name=name):
                removed = engine.unload_lora(name)
                self._lora_names = tuple(engine.lora_adapters())
                return removed
            case CanSeatLoRA(name=name):
                return engine.can_seat_lora(name)
        raise TypeError(f"no answer to {type(question).__name__}")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each streams' event loop per step, not one
        per request (each wake-up takes the GIL from this thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            streams = [None if out.request_id in self._closed else self._streams.get(out.request_id)
                       for out in outputs]
        for out, stream in zip(outputs, streams):
            if stream is not None:
                item = out if out.error is None else (ValueError if out.bad_input else InputsUnavailableError
                                                      if out.inputs_unavailable else RequestFailedError)(out.error)
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            if not loop.is_closed():  # a caller's loop that ended has nobody left to tell
                loop.call_soon_threadsafe(_put_all, items)
