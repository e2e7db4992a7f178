"""The contract between the OpenAI layer and whatever runs a request (the services, through the router).

The OpenAI layer hands over a tokenized `GenerateInput` and reads `Chunk`s of new token ids. Text,
stop strings and response formats stay in the OpenAI layer; closing the chunk stream early (client gone,
stop string found) aborts the request wherever it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, NamedTuple, Protocol

from epdserve.transport.channel.protocol import TokenLogprobs, TraceSpan, WireLoRA
from epdserve.shared.engine import SamplingParams


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its content hash, its file bytes, and its placeholder tokens' position."""

    mm_hash: str
    data: bytes
    offset: int
    length: int
    # An M-RoPE model's image: its (t, h, w) grid of merged tokens, from which the prompt's positions follow.
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    # Engine parameters; stop strings are the OpenAI layer's to check, so services never see them.
    params: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    cache_salt: str | None = None
    # An M-RoPE model's image prompt: its (temporal, height, width) position rows; None: 1-D positions.
    mrope_positions: tuple[tuple[int, ...], ...] | None = None
    lora: WireLoRA | None = None  # the LoRA adapter the request's `model` names; None: the base model


class Chunk(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token when requested, else empty
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None  # set on the first chunk: prompt tokens served from a prefix cache
    # Set on the first chunk with prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which of the request's n sequences (SamplingParams.n) the tokens belong to
    # Stages of the request the services (and the proxy's calls to them) timed until this chunk: on the
    # first chunk, and on the first of decode's (see tracing.py).
    trace: tuple[TraceSpan, ...] = ()


class GenerationError(Exception):
    """A request could not be run; `status` is the HTTP status the client gets."""

    def __init__(self, message: str, status: int = 500, error_type: str = "InternalServerError",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.retry_after = retry_after  # seconds, for the Retry-After header of a 503


class Backend(Protocol):
    def generate(self, request: GenerateInput) -> AsyncIterator[Chunk]:
        """Chunks of new tokens; each sequence's last has a finish_reason (with n > 1, the sequences'
        chunks interleave, told apart by `index`). Raises GenerationError."""
        ...
