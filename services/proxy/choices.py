"""A response's many choices: a completion's prompts run as requests of their own, side by side, and
`best_of` keeps the most likely of a prompt's sequences.

Choice `prompt_index * n + i` is sequence i of prompt `prompt_index`, as in vLLM and the OpenAI API.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Sequence, TypeVar

T = TypeVar("T")


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
