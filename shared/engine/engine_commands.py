"""What callers ask the engine's thread to do (`AsyncLLM`): one typed command each, applied between steps in
the order they were given."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Callable

from epdserve.shared.engine.kv_connector import KVConnector, LoadResult
from epdserve.shared.engine.request import Request


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a request (its stream is open already)."""
    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request wherever it is (a group: all its sequences); held KV included."""
    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """Free the blocks a KV connector kept for a finished request."""
    request_id: str


@dataclass(frozen=True, slots=True)
class FinishLoad:
    """A KV connector's load ended."""
    result: LoadResult


@dataclass(frozen=True, slots=True)
class AddConnector:
    """Let a KV connector feed requests and keep finished ones' KV; its loads end with `finish`, what it kept
    goes with `release`."""
    connector: KVConnector
    finish: Callable[[LoadResult], None]
    release: Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Query:
    """Run `fn(engine)` and hand its result to `future` (read-only questions: KV events, stats)."""
    fn: Callable
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True, slots=True)
class OnStep:
    """Call `callback(num_tokens)` on the engine's thread with the tokens each step computes."""
    callback: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop."""


Command = Submit | Abort | ReleaseKV | FinishLoad | AddConnector | Query | OnStep | Stop
