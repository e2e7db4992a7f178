"""The prompt's logprobs in responses: a completion's `echo` with `logprobs`, and vLLM's `prompt_logprobs`.

The engine scores every prompt token but the first (nothing predicts it), so both shapes start with null
there, as OpenAI's echo and vLLM do. JSON has no -inf and no NaN: every logprob a response carries (these and
the answer's, `json_logprob`) is clamped at LOGPROB_FLOOR, like vLLM's, and a non-finite one is the floor.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from epdserve.transport.channel.protocol import TokenLogprobs

LOGPROB_FLOOR = -9999.0


class Echo(NamedTuple):
    """A completion's prompt, echoed before its answer; `only`: max_tokens was 0, there is no answer."""

    text: str
    token_ids: list[int]
    only: bool


def json_logprob(logprob: float) -> float:
    """`logprob` as a response may carry it: NaN and infinities (weights gone bad, a masked token) would make
    the body invalid JSON, so they are LOGPROB_FLOOR, as is anything below it."""
    return max(logprob, LOGPROB_FLOOR) if math.isfinite(logprob) else LOGPROB_FLOOR


def echo_logprobs(echo: Echo, scores: list[TokenLogprobs] | None, label: Callable[[int], str],
                  text_of: Callable[[int], str]) -> dict:
    """The prompt's part of a completion's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset):
    `scores` holds one entry per prompt token after the first."""
    scores = [None, *(scores or ())]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, lp in zip(echo.token_ids, scores + [None] * (len(echo.token_ids) - len(scores))):
        out["tokens"].append(label(token))
        out["token_logprobs"].append(None if lp is None else json_logprob(lp.logprob))
        out["top_logprobs"].append(None if lp is None else {label(t): json_logprob(v) for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text_of(token))
    return out


def vllm_prompt_logprobs(prompt_ids: list[int], scores: list[TokenLogprobs] | None,
                         text_of: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` response field: null for the first token, then for each token
    {token id: {logprob, rank, decoded_token}} over its top alternatives and the token itself."""
    out: list[dict | None] = [None]
    for token, lp in zip(prompt_ids[1:], scores or ()):
        entry = {str(t): {"logprob": json_logprob(v), "rank": rank, "decoded_token": text_of(t)}
                 for rank, (t, v) in enumerate(lp.top, start=1)}
        entry.setdefault(str(token), {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": text_of(token)})
        out.append(entry)
    return out
