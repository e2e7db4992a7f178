"""The chaos suite's load: a fixed set of chat streams (text, an image, structured output, seeded sampling)
sent through the official `openai` client, each read on its own thread with the time of every chunk.

Every request is deterministic - greedy, or sampled from a fixed seed - so its answer under a fault must equal
the no-fault one token for token: token ids (logprobs with return_tokens_as_token_ids), text, finish reason
and completion tokens. Each wave carries a `cache_salt` of its own: no wave finds another's prompt blocks in a
prefix cache, so each of its requests really goes encoder -> prefill -> decode (KV pulled over the network)
and meets the fault wherever it is.
"""
from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import openai

MODEL = "llava-demo"
MAX_TOKENS = 64
JSON_SCHEMA = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string"},
                                                           "minItems": 20}}, "required": ["cities"]}


def requests(picture_png: bytes) -> dict[str, dict]:
    """name -> keyword arguments of chat.completions.create (without model, stream, salt)."""
    url = "data:image/png;base64," + base64.b64encode(picture_png).decode()
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    long = {"ignore_eos": True}  # every stream as long as the others: the fault lands mid-stream
    return {
        "text-story": dict(messages=[{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
                           **greedy, extra_body=long),
        "text-facts": dict(messages=[{"role": "user", "content": "List facts about the planets, one per line."}],
                           **greedy, extra_body=long),
        "image": dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                            {"type": "text", "text": "Describe this picture."}]}],
                      **greedy, extra_body=long),
        "json": dict(messages=[{"role": "user", "content": "Name twenty cities, as JSON."}], **greedy,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "cities", "schema": JSON_SCHEMA}}),
        "seeded": dict(messages=[{"role": "user", "content": "Write a poem about the sea."}], temperature=1.0,
                       top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, extra_body=long),
        "seeded-2": dict(messages=[{"role": "user", "content": "Invent a new colour and describe it."}],
                         temperature=0.7, seed=99, max_tokens=MAX_TOKENS, extra_body=long),
    }


class Answer(NamedTuple):
    """What a stream delivered: what must equal the no-fault run."""
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    completion_tokens: int | None


@dataclass
class Stream:
    """One streamed chat read on its own thread: its chunks' tokens and times, how it ended."""

    client: openai.OpenAI
    name: str
    kwargs: dict
    salt: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: BaseException | None = None
    times: list[float] = field(default_factory=list)  # monotonic: the request's start, then each chunk
    done_at: float | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, name=f"stream-{self.name}", daemon=True)

    def start(self) -> "Stream":
        self.times.append(time.monotonic())
        self.thread.start()
        return self

    def _read(self) -> None:
        extra = {**self.kwargs.get("extra_body", {}), "cache_salt": self.salt, "return_tokens_as_token_ids": True}
        kwargs = {k: v for k, v in self.kwargs.items() if k != "extra_body"}
        try:
            for event in self.client.chat.completions.create(model=MODEL, stream=True, logprobs=True,
                                                             stream_options={"include_usage": True},
                                                             extra_body=extra, **kwargs):
                self.times.append(time.monotonic())
                for choice in event.choices:
                    self.text.append(choice.delta.content or "")
                    if choice.logprobs and choice.logprobs.content:
                        self.token_ids += [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
                    self.finish_reason = choice.finish_reason or self.finish_reason
                if event.usage:
                    self.completion_tokens = event.usage.completion_tokens
        except BaseException as exc:  # noqa: BLE001 - kept and judged by the test
            self.error = exc
        finally:
            self.done_at = time.monotonic()

    @property
    def num_chunks(self) -> int:
        return len(self.times) - 1

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    @property
    def completed(self) -> bool:
        return (self.done_at is not None and self.error is None and self.finish_reason is not None
                and self.completion_tokens is not None)

    @property
    def answer(self) -> Answer:
        return Answer(tuple(self.token_ids), "".join(self.text), self.finish_reason, self.completion_tokens)

    @property
    def longest_gap(self) -> float:
        """Longest silence of the stream, in seconds: request to first chunk, between chunks, last chunk to its
        end (an error included) or, still open, to now."""
        times = self.times + [self.done_at if self.done_at is not None else time.monotonic()]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def describe(self) -> str:
        state = "completed" if self.completed else f"error {type(self.error).__name__}: {self.error}" \
            if self.error else "open" if self.done_at is None else f"ended ({self.finish_reason})"
        return f"{self.name}[{self.salt}]: {state}, {len(self.token_ids)} tokens, longest gap {self.longest_gap:.1f}s"


def start_wave(client: openai.OpenAI, catalog: dict[str, dict], salt: str) -> list[Stream]:
    return [Stream(client, name, kwargs, salt).start() for name, kwargs in catalog.items()]


def wait_started(streams: list[Stream], min_chunks: int, timeout: float) -> None:
    """Until every stream has `min_chunks` chunks (or ended)."""
    deadline = time.monotonic() + timeout
    while any(s.num_chunks < min_chunks and s.done_at is None for s in streams):
        if time.monotonic() > deadline:
            raise AssertionError("streams did not get going: " + "; ".join(s.describe() for s in streams))
        time.sleep(0.05)


def join_all(streams: list[Stream], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for stream in streams:
        stream.join(max(0.0, deadline - time.monotonic()))
