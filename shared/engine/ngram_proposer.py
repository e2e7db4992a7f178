"""Prompt lookup ("ngram" speculative decoding): draft tokens for a request from its own tokens, no model.

If the request's last n tokens occurred earlier in its prompt or output, whatever followed that occurrence
is a good guess at what comes next: code being rewritten, text being quoted, JSON keys repeated. n runs
from prompt_lookup_max down to prompt_lookup_min (the longest match wins); of several occurrences the
latest that is followed by k tokens is taken, the one closest to what is being written now.

A draft never holds one of the request's stop tokens, nor reaches its max_tokens: a draft token is
verified by sampling the position that follows it, and a run that ends the request there needs no such
position. So everything the verification accepts continues the request (speculative.py).
"""
from __future__ import annotations

import numpy as np

from epdserve.shared.config import SpeculativeConfig
from epdserve.shared.engine.request import Request


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request) -> list[int]:
        """Up to k draft tokens to follow `request`'s tokens (maybe none)."""
        room = draft_room(request, self.k)
        if room <= 0:
            return []
        return before_stop(request, _lookup(token_array(request), self.min_n, self.max_n, room))

    def start_step(self) -> None:
        """Nothing to do before a step's proposals (suffix_proposer.py's forgets finished requests)."""

    def fill(self, scheduled, block_copies=()) -> None:
        """Nothing to do once the step is scheduled: the drafts were whole before (draft_proposer.py's are not)."""


def draft_room(request: Request, k: int) -> int:
    """How many draft tokens `request` may take: at most k, and never its last token (max_tokens)."""
    return min(k, request.max_output_tokens - request.num_output_tokens - 1)


def before_stop(request: Request, draft: list[int]) -> list[int]:
    """`draft` up to the first of the request's stop tokens."""
    for i, token_id in enumerate(draft):
        if token_id in request.stop_token_ids:
            return draft[:i]
    return draft


def token_array(request: Request) -> np.ndarray:
    return np.fromiter(request.all_token_ids, np.int64, request.num_tokens)


def _lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens after the latest earlier occurrence of the longest suffix of `tokens` of length in
    [min_n, max_n] that occurs earlier; [] when none does."""
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return []
    # The earlier occurrences of the last token (a match's last position, never the last token itself), and
    # how far back each one's match with the suffix reaches, up to max_n: one pass over the tokens, then a few
    # over these candidates only (a request's proposal is asked for every step).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = np.ones(len(ends), np.int64)
    going = np.ones(len(ends), bool)
    for back in range(1, max_n):
        going &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[length - 1 - back])
        matched += going
    for n in range(max_n, min_n - 1, -1):
        hits = ends[matched >= n] - (n - 1)  # where each match of length n starts, in order
        if len(hits):
            # The latest occurrence followed by k tokens; else the earliest, followed by the most (in a loop
            # that has only just begun repeating, the latest is followed by the current token alone).
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []
