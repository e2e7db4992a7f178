"""`AsyncLLM`: the engine loop on its own thread, requests as async iterators of incremental outputs.

The engine is touched only by its thread: callers hand it additions and aborts through a queue, and get
outputs back on their event loop. torch releases the GIL inside its kernels, so the event loop stays
responsive while a step runs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator

from epdserve.shared.engine import LLMEngine, PromptType
from epdserve.shared.llm import build_engine_config
from epdserve.shared.outputs import RequestOutput
from epdserve.shared.request import Request
from epdserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    """Where one request's outputs land, on the caller's event loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="epdserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, **kwargs) -> AsyncLLM:
        """Build the engine like `LLM(model, **kwargs)` does."""
        return cls(LLMEngine(build_engine_config(model, **kwargs)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: PromptType | Request, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the request progresses (by its `output_kind`); the last one has finished=True.

        Leaving the iteration early (break, cancellation, client gone) aborts the request.
        """
        if self._dead is not None:
            raise EngineDeadError("the engine loop has stopped") from self._dead
        if isinstance(prompt, Request):
            request = prompt
        else:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            request = self.engine.make_request(request_id, prompt, sampling_params, **kwargs)
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
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
                self._commands.put(("abort", request.request_id))
            self._streams.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # -- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                # Block for work only when the engine is idle.
                self._apply(self._commands.get() if not self.engine.has_unfinished_requests() else None)
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # the loop must not die silently with requests waiting on it
            logger.exception("engine loop failed")
            self._dead = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"engine loop failed: {exc!r}"))

    def _apply(self, command: tuple[str, object] | None) -> None:
        if command is None:
            return
        kind, arg = command
        if kind == "add":
            try:
                self.engine.add_request(arg.request_id, arg)
            except ValueError as exc:
                stream = self._streams.get(arg.request_id)
                if stream is not None:
                    stream.put(exc)
        elif kind == "abort":
            self._deliver(self.engine.abort_request(arg))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
