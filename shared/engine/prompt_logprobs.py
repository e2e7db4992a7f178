"""Log-probabilities of prompt tokens (SamplingParams.prompt_logprobs), computed by the model runner.

The logits at position p predict token p + 1, so a step that computes positions [start, end) of a request
scores its prompt tokens start + 1 .. min(end, num_prompt_tokens - 1): the first prompt token has none.
A chunked prefill scores its prompt chunk by chunk; a recompute after preemption scores positions again,
and the output processor keeps the first score of each.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampler import SampledLogprobs


class PromptSpan(NamedTuple):
    """Prompt tokens one step scores for one request: tokens first_token .. first_token + num - 1,
    predicted by batch rows first_row .. first_row + num - 1 of the step's hidden states."""

    request: Request
    first_token: int
    first_row: int
    num: int


class PromptScores(NamedTuple):
    first_token: int  # prompt index of entries[0]
    entries: list[SampledLogprobs]


def prompt_span(request: Request, start: int, end: int, first_row: int) -> PromptSpan | None:
    """The span a step computing positions [start, end) of `request` (from batch row `first_row`) scores."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    first, last = start + 1, min(end, request.num_prompt_tokens - 1)
    if first > last:
        return None
    return PromptSpan(request, first, first_row + first - 1 - start, last - first + 1)


# Rows scored at once: bounds the [rows, vocab] float32 logits a long prompt chunk would otherwise need.
_ROWS_PER_PASS = 256


def score_prompt_spans(hidden: torch.Tensor, spans: list[PromptSpan],
                       compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PromptScores]:
    """request id -> its span's scores, from the step's hidden states [num_tokens, hidden_size]."""
    out = {}
    for span in spans:
        tokens = span.request.all_token_ids
        entries: list[SampledLogprobs] = []
        for lo in range(0, span.num, _ROWS_PER_PASS):
            hi = min(lo + _ROWS_PER_PASS, span.num)
            logits = compute_logits(hidden[span.first_row + lo:span.first_row + hi]).cpu()
            entries += score_tokens(logits, tokens[span.first_token + lo:span.first_token + hi],
                                    span.request.sampling_params.prompt_logprobs)
        out[span.request.request_id] = PromptScores(span.first_token, entries)
    return out


def score_tokens(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[SampledLogprobs]:
    """Row i of `logits` [n, vocab] scored for token_ids[i]: its logprob and rank, and the top `num_top`.
    Of the raw model distribution, as the sampler reports a sampled token's."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    actual = logprobs.gather(1, torch.tensor(token_ids).unsqueeze(1))  # [n, 1]
    ranks = ((logprobs > actual).sum(-1) + 1).tolist()
    top_lp, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
    top_lp, top_ids = top_lp[:, :num_top].tolist(), top_ids[:, :num_top].tolist()
    return [SampledLogprobs(lp, rank, list(zip(ids, lps)))
            for lp, rank, ids, lps in zip(actual.squeeze(1).tolist(), ranks, top_ids, top_lp)]
