"""A response's choices: each one's output as it arrives (`Choice`), a completion's prompts run as requests of
their own side by side (`merge`), and `best_of` keeping the most likely of a prompt's sequences.

Choice `prompt_index * n + i` is sequence i of prompt `prompt_index`, as in vLLM and the OpenAI API.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Sequence, TypeVar

from epdserve.services.proxy.generation import Chunk
from epdserve.services.proxy.prompt_logprobs import json_logprob
from epdserve.shared.engine import SamplingParams
from epdserve.shared.processing.detokenizer import IncrementalDetokenizer
from epdserve.transport.channel.protocol import TokenLogprobs

T = TypeVar("T")


class Choice:
    """One choice's output, accumulated as its chunks arrive: tokens, logprobs, the text the client has
    not seen yet (held back while it may still start a stop string), and how it finished."""

    def __init__(self, detok: IncrementalDetokenizer, params: SamplingParams, index: int = 0) -> None:
        self.detok = detok
        self.params = params
        self.index = index  # the choice's
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token after the first

    def add(self, chunk: Chunk) -> None:
        if chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        for i, token in enumerate(chunk.token_ids):
            self.token_ids.append(token)
            if chunk.logprobs:
                self.logprobs.append(chunk.logprobs[i])
            # As in vLLM, stop strings count only once min_tokens are out.
            stop = self.detok.add_token(token, len(self.token_ids) >= self.params.min_tokens)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                return
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        return sum(json_logprob(lp.logprob) for lp in self.logprobs)  # NaN would make best_of's order arbitrary

    def take_delta(self) -> tuple[str, list[int], list[TokenLogprobs]]:
        """What the client has not seen yet (text held back while it may still start a stop string)."""
        text = self.detok.visible_text(self.finished)
        delta = text[self.sent_chars:]
        tokens, logprobs = self.token_ids[self.sent_tokens:], self.logprobs[self.sent_tokens:]
        self.sent_chars, self.sent_tokens = len(text), len(self.token_ids)
        return delta, tokens, logprobs


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they come. Each stream waits until its previous item has been taken
    up (the consumer asked for the next one), so an item - a result the stream updates in place - does
    not change while the consumer reads it. A failing stream ends them all, with its error; leaving early
    closes every stream."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                taken = asyncio.Event()
                queue.put_nowait((item, taken))
                await taken.wait()
        except Exception as exc:
            queue.put_nowait((exc, None))
        finally:
            queue.put_nowait((done, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item, taken = await queue.get()
            if item is done:
                running -= 1
            elif taken is None:
                raise item
            else:
                yield item
                taken.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best_of(results: list[T], n: int, cumulative_logprob: Callable[[T], float]) -> list[T]:
    """The n results with the highest cumulative logprob, best first (ties: the lower index first)."""
    return sorted(results, key=cumulative_logprob, reverse=True)[:n]
