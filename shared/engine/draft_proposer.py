"""A draft model ("draft_model" speculative decoding): a small model of the same vocabulary proposes each
request's next k tokens, greedily, and the target verifies them (speculative.py).

The draft runs on a model runner of its own, with a KV cache of its own laid out like the target's and
indexed by the same block tables: a request's draft KV sits in the blocks the scheduler gave the request.
So the draft needs slots that exist only once the step is scheduled: before scheduling it reserves k draft
tokens (placeholders, which the scheduler cuts to the step's room like any drafts), and after it fills
them in - one forward over the tokens its cache lacks (the whole prompt the first time it sees a request),
then one per further draft token.

What its cache holds for a request is tracked here: the positions computed, with the blocks they are in.
Positions the target rejected and blocks the request no longer holds (preemption, a recompute) are computed
again. The draft only proposes, so its KV - even its rounding in a different batch - cannot change a token
the request outputs; it changes how many drafts are accepted. For the same reason the draft sees an image's
placeholder tokens, not its embeddings (those are the target's, made for the target's hidden size); an
M-RoPE draft still rotates every token by the request's 3-D positions, which follow from the prompt's layout.
"""
from __future__ import annotations

import weakref
from dataclasses import replace

from epdserve.shared.config import EngineConfig
from epdserve.shared.engine.model_runner import ModelRunner
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import ScheduledRequest
from epdserve.shared.engine.step_timer import StepTimer

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class _DraftView:
    """A request as the draft's runner sees it: its tokens then the drafts so far, its own computed count,
    greedy sampling and nothing else."""

    sampling_params = _GREEDY
    spec_token_ids: list[int] = []
    forks: list = []
    mm_placeholders = ()
    logit_bias = grammar = generator = None
    stop_token_ids = frozenset()
    output_token_ids: list[int] = []
    num_output_tokens = 0

    def __init__(self, request: Request, num_computed: int) -> None:
        self.request_id = request.request_id
        self.block_ids = request.block_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.all_token_ids = list(request.all_token_ids)
        self.num_computed_tokens = num_computed
        self._request = request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def rope_positions(self, start: int, end: int):
        """An M-RoPE draft's positions are the request's: the prompt's 3-D positions, then its largest plus one
        on - the drafts past the request's tokens included - as the target computes them."""
        return self._request.rope_positions(start, end)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_blocks: int, timer: StepTimer) -> None:
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.runner = ModelRunner(replace(config, model=spec.draft, speculative=None), num_blocks, timer)
        # request -> (positions whose draft KV is computed, the blocks they are in); gone with the request.
        self._computed: weakref.WeakKeyDictionary[Request, tuple[int, tuple[int, ...]]] = weakref.WeakKeyDictionary()

    def propose(self, request: Request) -> list[int]:
        """Reserve up to k draft slots (placeholder tokens, filled in by `fill` once the step is scheduled)."""
        room = min(self.k, request.max_output_tokens - request.num_output_tokens - 1)
        return [0] * max(room, 0)

    def fill(self, scheduled: list[ScheduledRequest], block_copies=()) -> None:
        """Write the draft tokens of every scheduled request that kept some, greedy from the draft model."""
        views = []
        for request, num_new in scheduled:
            if request.spec_token_ids and request.num_computed_tokens + num_new > request.num_tokens:
                views.append((request, _DraftView(request, self._valid(request))))
        if not views:
            if block_copies:
                self.runner.execute([], (), block_copies)
            return
        active = views
        for j in range(max(len(r.spec_token_ids) for r, _ in views)):
            batch = [(r, v) for r, v in active if j < len(r.spec_token_ids)]
            if not batch:
                break
            out = self.runner.execute([ScheduledRequest(v, v.num_tokens - v.num_computed_tokens) for _, v in batch],
                                      (), block_copies if j == 0 else ())
            active = []
            for request, view in batch:
                # A failed draft forward leaves the placeholders: drafts like any others, just poor ones.
                if view.request_id in out.token_ids:
                    request.spec_token_ids[j] = out.token_ids[view.request_id][0]
                    view.num_computed_tokens = view.num_tokens
                    view.all_token_ids.append(request.spec_token_ids[j])
                    active.append((request, view))
        for request, view in views:
            blocks = -(-view.num_computed_tokens // self.runner.block_size)
            self._computed[request] = (view.num_computed_tokens, tuple(request.block_ids[:blocks]))

    def _valid(self, request: Request) -> int:
        """Leading positions of `request` whose draft KV is right: computed with the tokens the request has
        now (rejected drafts' positions are not), in blocks it still holds."""
        computed, blocks = self._computed.get(request, (0, ()))
        computed = min(computed, request.num_computed_tokens)
        held = -(-computed // self.runner.block_size)
        return computed if tuple(request.block_ids[:held]) == blocks[:held] else 0
