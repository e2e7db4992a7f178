"""Suffix decoding ("suffix" speculative decoding): draft tokens from suffix trees, no model.

Two trees of token counts: one per request over its own prompt and output, and one over the outputs of the
requests that finished before it (the last `suffix_decoding_max_cached_requests` of them) - agentic and
repetitive traffic writes the same things again. Each tree holds every run of at most
`suffix_decoding_max_tree_depth` consecutive tokens of its sequences, with how often it occurs.

To propose, the longest suffix of the request's tokens that the tree has seen followed by something is
found (m tokens long, at most the depth less what the draft needs), and the draft walks on from it, each
time to the token that most often came next, while the product of those tokens' frequencies stays at least
`suffix_decoding_min_token_prob`, for at most `suffix_decoding_max_spec_factor` * m tokens (a long match
earns a long draft) and `num_speculative_tokens`. Of the two trees' drafts the one with the larger
expected length (the sum of the running products) is proposed.

As for prompt lookup, a draft never holds one of the request's stop tokens nor reaches its max_tokens.
"""
from __future__ import annotations

from collections import deque

from epdserve.shared.config import SpeculativeConfig
from epdserve.shared.engine.request import Request, RequestStatus


class SuffixTree:
    """Every run of at most `depth` consecutive tokens of the sequences added, counted: node = [count,
    {token: child}], the root's count unused."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: list = [0, {}]

    def extender(self) -> "SuffixExtender":
        return SuffixExtender(self)

    def add(self, tokens: list[int]) -> None:
        extender = self.extender()
        for token in tokens:
            extender.append(token)

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
        longest = min(len(context), self.depth - 1)
        # The longest suffix of the context followed by something here: a suffix that is is followed by
        # something for every shorter suffix too, so it is found by halving.
        low, high, found = 0, longest, None
        while low < high:
            m = (low + high + 1) // 2
            node = self.node(context[len(context) - m:])
            if node is not None and node[1]:
                low, found = m, node
            else:
                high = m - 1
        if not low:
            return [], 0.0
        node = found
        room = min(max_tokens, int(spec_factor * low), self.depth - low)
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < room and node[1]:
            token, child = max(node[1].items(), key=lambda item: item[1][0])
            prob *= child[0] / sum(c[0] for c in node[1].values())
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


class SuffixExtender:
    """Adds a sequence to a tree one token at a time (a request's, as it grows): the nodes of the runs that end
    at its last token are kept, and each new token extends them."""

    def __init__(self, tree: SuffixTree) -> None:
        self.tree = tree
        self.ends: list[list] = []  # nodes of the runs ending at the last token, shortest first
        self.size = 0  # tokens added

    def append(self, token: int) -> None:
        ends = [self.tree.root, *self.ends[:self.tree.depth - 1]]
        self.ends = []
        for node in ends:
            child = node[1].get(token)
            if child is None:
                child = node[1][token] = [0, {}]
            child[0] += 1
            self.ends.append(child)
        self.size += 1


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.outputs = SuffixTree(self.depth)  # finished requests' outputs
        self.cached: deque[list[int]] = deque()
        # request id -> (request, its tree, the extender that has added its tokens so far)
        self.requests: dict[str, tuple[Request, SuffixTree, SuffixExtender]] = {}

    def start_step(self) -> None:
        """Requests that ended since the last step: their trees go, their outputs (if they ended by a stop or
        their length, not an abort or an error) join the cache of outputs."""
        for request_id, (request, _, _) in list(self.requests.items()):
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
        entry = self.requests.get(request.request_id)
        if entry is None:
            tree = SuffixTree(self.depth)
            entry = self.requests[request.request_id] = (request, tree, tree.extender())
        _, tree, extender = entry
        tokens = request.all_token_ids
        for token in tokens[extender.size:]:
            extender.append(token)
        room = min(self.k, request.max_output_tokens - request.num_output_tokens - 1)
        if room <= 0:
            return []
        context = tokens[-self.depth:]
        draft, score = tree.speculate(context, room, self.spec_factor, self.min_prob)
        if self.cached:
            other, other_score = self.outputs.speculate(context, room, self.spec_factor, self.min_prob)
            if other_score > score:
                draft = other
        for i, token_id in enumerate(draft):
            if token_id in request.stop_token_ids:
                return draft[:i]
        return draft

    def fill(self, scheduled, block_copies=()) -> None:
        """Nothing to do once the step is scheduled: the drafts were whole before."""
