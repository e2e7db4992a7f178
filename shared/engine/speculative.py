"""Speculative decoding: verifying draft tokens so that the output is exactly that of one token per step.

A request with draft tokens d1..dk (ngram_proposer.py) computes, in one step, its last token and the k
drafts: k + 1 positions through the paged cache, as a chunked prefill does. Position i's logits are what a
step of its own would have had, had d1..di been sampled before it. So each position is sampled as that
step would have sampled it - the logits processors (logit_bias, min_tokens, penalties, the grammar's
bitmask) see the request's tokens followed by the drafts before the position, and a seeded request draws
the noise of that position (sampler.seeded_generator) - and the drafts are accepted while each equals the
token sampled at the position before it. The first position whose token differs from its draft gives that
token (or, with every draft accepted, the last position gives one more), and the run ends there.

The tokens are then those that one token per step gives - identical for greedy and for seeded sampling,
and from the same distribution for unseeded sampling. For a draft that is a single proposed token (a point
mass) this is rejection sampling: a draft is kept with the probability the target gives it. Every sampled
position draws its own noise and yields one token, as a step of its own would.

A run also ends early where a step of its own would have ended the request, or failed it: where a draft
completes the request's grammar, or where a position's sampling fails (its grammar leaves no token, its
parameters break the sampler) - the tokens before it stand, and the next step meets that position again.
The grammar takes each draft on trial while the positions after it are sampled, and gives them back after.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from epdserve.shared.engine.outputs import SpecDecodeCounts
from epdserve.shared.engine.request import Request


class DraftPosition:
    """`request` as the sampler sees it at the position after its first `num_drafts` draft tokens."""

    __slots__ = ("request", "num_drafts")

    def __init__(self, request: Request, num_drafts: int) -> None:
        self.request = request
        self.num_drafts = num_drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.request.spec_token_ids[:self.num_drafts]

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.request.spec_token_ids[:self.num_drafts]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.num_drafts

    def __getattr__(self, name: str):
        return getattr(self.request, name)


class Sampled(NamedTuple):
    """One sampling call's result, as the model runner gives it: token and logprobs by request id, and the
    ids whose sampling failed."""

    token_ids: dict[str, int]
    logprobs: dict[str, object]
    failed: dict[str, object]


def verify_drafts(logits: torch.Tensor, spec: list[tuple[Request, int]], token_ids: dict[str, list[int]],
                  logprobs: dict[str, list], sample: Callable[[torch.Tensor, list], Sampled]) -> None:
    """Sample the draft positions of the requests in `spec` ((request, logits row of its position after d1)),
    extending in place each one's tokens (and logprobs, if it wants them): `token_ids` holds the token sampled
    at its first position already. `sample(rows of logits, requests)` samples one token per row."""
    live = [(r, row) for r, row in spec if token_ids.get(r.request_id, [None])[0] == r.spec_token_ids[0]]
    on_trial: dict[str, int] = {}  # request id -> drafts its grammar took on trial
    num_drafts = 1
    while live:
        views, rows = [], []
        for request, row in live:
            if request.grammar is not None:
                on_trial[request.request_id] = on_trial.get(request.request_id, 0) + 1
                request.grammar.accept(request.spec_token_ids[num_drafts - 1])
                # The draft was sampled under the grammar's bitmask: the matcher takes it.
                assert request.grammar.rejected_token is None
                if request.grammar.is_terminated:
                    continue  # the draft completed the output: the request ends with it
            views.append(DraftPosition(request, num_drafts))
            rows.append(row + num_drafts - 1)
        if not views:
            break
        out = sample(logits[rows], views)
        live = []
        for view, row in zip(views, rows):
            request, request_id = view.request, view.request_id
            if request_id in out.failed or request_id not in out.token_ids:
                continue
            token_id = out.token_ids[request_id]
            token_ids[request_id].append(token_id)
            if request_id in out.logprobs:
                logprobs[request_id].append(out.logprobs[request_id])
            if num_drafts < len(request.spec_token_ids) and token_id == request.spec_token_ids[num_drafts]:
                live.append((request, row - num_drafts + 1))
        num_drafts += 1
    for request, _ in spec:
        if request.request_id in on_trial:
            request.grammar.rollback(on_trial[request.request_id])


class SpecDecodeStats:
    """Draft tokens verified and accepted, as vLLM counts them (`vllm:spec_decode_*`)."""

    def __init__(self) -> None:
        self.num_drafts = 0  # verification runs: a request's drafts in one step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []  # [i]: runs whose draft i + 1 was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_accepted:
            self.num_accepted_tokens_per_pos.extend([0] * (num_accepted - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def counts(self, num_positions: int) -> SpecDecodeCounts:
        """The counters, with one per-position count for each of `num_positions` draft positions at least."""
        per_pos = self.num_accepted_tokens_per_pos
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                tuple(per_pos) + (0,) * (num_positions - len(per_pos)))
