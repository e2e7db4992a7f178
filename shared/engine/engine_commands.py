"""What callers ask the engine's thread to do (`AsyncLLM`): one typed command each, applied between steps in
the order they were given. A `Question` is answered: its result (or the exception it raised) goes to its
`future`; the others are told, not answered."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Callable

from epdserve.shared.engine.kv_connector import KVConnector, LoadResult
from epdserve.shared.engine.lora_request import LoRARequest
from epdserve.shared.engine.request import Request
from epdserve.shared.models.lora_adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a request (its stream is open already)."""
    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request wherever it is (a group: all its sequences); held KV included. `to_stream`: its aborted
    output goes to the id's open stream. False where its caller's stream has closed already: the id may be in use
    again by then (a request sent here once more), and that request's stream must not hear of this one's end."""
    request_id: str
    to_stream: bool = True


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
class Expect:
    """A request with these `kv_transfer_params` is about to be submitted: tell the KV connectors
    (`KVConnector.expect`)."""
    request_id: str
    kv_transfer_params: object


@dataclass(frozen=True, slots=True)
class Question:
    """A command whose answer goes to `future`. Cancelled before it was applied, it is not applied."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, kw_only=True,
                                              compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TakeKVEvents(Question):
    """The prefix cache's (and the tiers') KV events from batch `next_seq` on (`LLMEngine.kv_events`: it seals
    the open batch): a KVEventBatch."""
    next_seq: int | None


@dataclass(frozen=True, slots=True)
class FindLoRA(Question):
    """The adapter the engine keeps under the request's name, read from its path, or None."""
    lora_request: LoRARequest


@dataclass(frozen=True, slots=True)
class LoadLoRA(Question):
    """Keep an adapter read already, off the engine's thread (`LLMEngine.read_lora`); answered with it."""
    adapter: LoRAAdapter


@dataclass(frozen=True, slots=True)
class UnloadLoRA(Question):
    """Forget adapter `name`: True, or False if it was not kept."""
    name: str


@dataclass(frozen=True, slots=True)
class CanSeatLoRA(Question):
    """Whether a request with adapter `name` (kept already) would find it a slot now."""
    name: str


@dataclass(frozen=True, slots=True)
class OnStep:
    """Call `callback(num_tokens)` on the engine's thread with the tokens each step computes."""
    callback: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop."""


Command = (Submit | Abort | ReleaseKV | FinishLoad | AddConnector | Expect | OnStep | Stop | TakeKVEvents | FindLoRA
           | LoadLoRA | UnloadLoRA | CanSeatLoRA)
