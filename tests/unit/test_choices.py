"""Merging a completion's per-prompt streams: every item once, an item unchanged while it is read, a
failing stream ends the merge with its error and closes the others; best_of ranks by cumulative logprob."""
import asyncio

import pytest

from epdserve.services.proxy.choices import best_of, merge


async def counter(name: str, n: int, log: list, state: dict):
    """Yields one mutable dict, updated in place before each yield (as `_run` does with its results)."""
    try:
        for i in range(n):
            state[name] = i
            yield (name, state)
            await asyncio.sleep(0)
    finally:
        log.append(f"{name} closed")


def test_every_item_once_and_unchanged_while_read():
    async def main():
        log, seen = [], []
        states = {"a": {}, "b": {}}
        async for name, state in merge([counter("a", 3, log, states["a"]), counter("b", 2, log, states["b"])]):
            value = state[name]
            await asyncio.sleep(0.001)  # the other stream runs meanwhile; this one must wait
            assert state[name] == value
            seen.append((name, value))
        return seen, log

    seen, log = asyncio.run(main())
    assert sorted(seen) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert [v for n, v in seen if n == "a"] == [0, 1, 2]
    assert sorted(log) == ["a closed", "b closed"]


def test_a_failing_stream_ends_the_merge_and_closes_the_others():
    async def failing():
        yield 1
        raise ValueError("broken")

    async def main():
        log = []
        with pytest.raises(ValueError, match="broken"):
            async for _ in merge([failing(), counter("slow", 1000, log, {})]):
                pass
        return log

    assert asyncio.run(main()) == ["slow closed"]


def test_best_of_keeps_the_most_likely():
    assert best_of([("a", -3.0), ("b", -1.0), ("c", -2.0)], 2, lambda r: r[1]) == [("b", -1.0), ("c", -2.0)]
