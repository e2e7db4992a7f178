"""Suffix decoding ("suffix" speculative decoding): draft tokens from suffix trees, no model.

Two sources of token counts: the request's own prompt and output, and a tree over the outputs of the
requests that finished before it (the last `suffix_decoding_max_cached_requests` of them) - agentic and
repetitive traffic writes the same things again. The tree holds every run of at most
`suffix_decoding_max_tree_depth` consecutive tokens of its sequences, with how often it occurs; the
request's own tokens are searched as they are (`own_draft`, numpy over the token array: what a tree of them
would answer, without building one per request, which in Python cost more than the drafts saved).

To propose, the longest suffix of the request's tokens that the source has seen followed by something is
found (m tokens long, at most the depth less the draft's room), and the draft walks on from it, each
time to the token that most often came next, while the product of those tokens' frequencies stays at least
`suffix_decoding_min_token_prob`, for at most `suffix_decoding_max_spec_factor` * m tokens (a long match
earns a long draft) and `num_speculative_tokens`. Of the two sources' drafts the one with the larger
expected length (the sum of the running products) is proposed.

As for prompt lookup, a draft never holds one of the request's stop tokens nor reaches its max_tokens.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from epdserve.shared.config import SpeculativeConfig
from epdserve.shared.engine.ngram_proposer import before_stop, draft_room, token_array
from epdserve.shared.engine.request import Request, RequestStatus


class SuffixTree:
    """Every run of at most `depth` consecutive tokens of the sequences added, counted: node = [count,
    {token: child}], the root's count unused."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: list = [0, {}]

    def add(self, tokens: list[int]) -> None:
        ends: list[list] = []  # nodes of the runs that end at the last token added, shortest first
        for token in tokens:
            grown = []
            for node in (self.root, *ends[:self.depth - 1]):
                child = node[1].get(token)
                if child is None:
                    child = node[1][token] = [0, {}]
                child[0] += 1
                grown.append(child)
            ends = grown

    def remove(self, tokens: list[int]) -> None:
        """Take back a sequence `add` put in (its counts; nodes left with none go)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node[1][token]
                child[0] -= 1
                if child[0] == 0:
                    del node[1][token]
                    break
                node = child

    def node(self, tokens: list[int]) -> list | None:
        node = self.root
        for token in tokens:
            node = node[1].get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], max_tokens: int, spec_factor: float,
                  min_prob: float) -> tuple[list[int], float]:
        """A draft to follow `context` and its expected length (the sum of its tokens' running products)."""
        # At most the depth less the draft's room: a match as deep as the tree leaves nothing to follow it.
        longest = min(len(context), max(self.depth - max_tokens, 1))
        # The longest suffix of the context followed by something here: a suffix that is followed by something
        # is so for every shorter suffix too, so it is found by halving.
        low, high, node = 0, longest, None
        while low < high:
            m = (low + high + 1) // 2
            candidate = self.node(context[len(context) - m:])
            if candidate is not None and candidate[1]:
                low, node = m, candidate
            else:
                high = m - 1
        if not low:
            return [], 0.0
        room = min(max_tokens, int(spec_factor * low), self.depth - low)
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < room and node[1]:
            # The most frequent; of equals, the smallest token (as own_draft takes it).
            token, child = max(node[1].items(), key=lambda item: (item[1][0], -item[0]))
            prob *= child[0] / sum(c[0] for c in node[1].values())
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


def own_draft(tokens: np.ndarray, depth: int, max_tokens: int, spec_factor: float,
              min_prob: float) -> tuple[list[int], float]:
    """SuffixTree.speculate's draft for a tree of `tokens` alone, from `tokens` itself: its last run of m
    tokens is matched where it occurred before (each occurrence by the position it ends at, one that is
    followed by a token), growing m while any remain."""
    n = len(tokens)
    ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])
    m = 0
    if len(ends):
        m = 1
        while m < min(max(depth - max_tokens, 1), n - 1):
            longer = ends[ends >= m]
            longer = longer[tokens[longer - m] == tokens[n - 1 - m]]
            if not len(longer):
                break
            ends, m = longer, m + 1
    if not m:
        return [], 0.0
    room = min(max_tokens, int(spec_factor * m), depth - m)
    draft, prob, score = [], 1.0, 0.0
    while len(draft) < room:
        ends = ends[ends + 1 + len(draft) < n]
        if not len(ends):
            break
        values, counts = np.unique(tokens[ends + 1 + len(draft)], return_counts=True)
        best = int(np.argmax(counts))
        prob *= counts[best] / len(ends)
        if prob < min_prob:
            break
        draft.append(int(values[best]))
        score += prob
        ends = ends[tokens[ends + len(draft)] == values[best]]
    return draft, score


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.outputs = SuffixTree(self.depth)  # finished requests' outputs
        self.cached: deque[list[int]] = deque()
        self.requests: dict[str, Request] = {}  # those proposed for, until they end

    def start_step(self) -> None:
        """Requests that ended since the last step are forgotten; their outputs (if they ended by a stop or
        their length, not an abort or an error) join the cache of outputs."""
        for request_id, request in list(self.requests.items()):
            if not request.is_finished:
                continue
            del self.requests[request_id]
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
                    and self.max_cached and request.output_token_ids:
                self.cached.append(list(request.output_token_ids))
                self.outputs.add(self.cached[-1])
                if len(self.cached) > self.max_cached:
                    self.outputs.remove(self.cached.popleft())

    def propose(self, request: Request) -> list[int]:
        """Up to k draft tokens to follow `request`'s tokens (maybe none)."""
        self.requests[request.request_id] = request
        room = draft_room(request, self.k)
        if room <= 0:
            return []
        draft, score = own_draft(token_array(request), self.depth, room, self.spec_factor, self.min_prob)
        if self.cached:
            context = request.all_token_ids[-self.depth:]
            other, other_score = self.outputs.speculate(context, room, self.spec_factor, self.min_prob)
            if other_score > score:
                draft = other
        return before_stop(request, draft)

    def fill(self, scheduled, block_copies=()) -> None:
        """Nothing to do once the step is scheduled: the drafts were whole before."""
