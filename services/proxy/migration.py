"""Requests that outlive their instance: a stream lost mid-way continues on another decode (or unified) instance.

When the instance streaming a request dies, drops its connection (killed, OOM-killed, frozen past its
heartbeats), drains past its grace, or a delta of its stream is lost on the way (pushes are at most once: a
delta that does not start where the last one ended, `TokenDelta.offset`, follows a lost one; a stream silent
for `hold_check` seconds whose instance no longer runs it lost its last one), the proxy does
not end the request: each of its unfinished sequences goes to another instance with the prompt and every
token already delivered (GenerateRequest.output_token_ids), routed like any request (to whichever holds
most of the prompt's blocks); that instance recomputes their KV and the stream resumes with the next token -
none repeated, none missing. The rest continues too, because the engine takes the delivered tokens as its own
output (shared/engine/handoff.py): a seeded request's random stream at its position, the structured-output
matcher replayed over them, penalties, min_tokens and max_tokens. A sequence of n > 1 continues as a
request of its own with the seed of its place in the group (sequence i samples from seed + i). Stop
strings, tool-call parsing, logprobs and usage live in the OpenAI layer, which sees one stream throughout.

What a request may have caused itself (bad input, an internal error of an instance that is still up) is
never migrated: retried, it could take every instance down in turn. `--migration-limit` bounds the hops of
one request; past it, or with no instance left, the request ends as it would have: an error event and
[DONE]. Each hop is counted (`epdserve:request_migrations_total{reason}`) and shows in the request's trace
as a `proxy.migrate:<reason>` span, from the loss to the first token after it.
"""
from __future__ import annotations

from epdserve.services.proxy.generation import Chunk, GenerationError


class StreamLost(GenerationError):
    """The instance streaming a request was lost, or part of its stream (`reason`: `instance_lost`, `drained`,
    `tokens_lost`); the request may continue elsewhere. If it cannot, the client gets this error."""

    def __init__(self, message: str, reason: str, status: int, error_type: str) -> None:
        super().__init__(message, status, error_type)
        self.reason = reason


class Progress:
    """What a request's client has been sent so far: each sequence's tokens, and which sequences finished."""

    __slots__ = ("tokens", "finished")

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished: set[int] = set()

    def record(self, chunk: Chunk) -> None:
        self.tokens[chunk.index] += chunk.token_ids
        if chunk.finish_reason is not None:
            self.finished.add(chunk.index)

    @property
    def delivered(self) -> bool:
        """Whether the client has been sent anything yet."""
        return bool(self.finished) or any(self.tokens)

    def unfinished(self) -> list[int]:
        return [i for i in range(len(self.tokens)) if i not in self.finished]
