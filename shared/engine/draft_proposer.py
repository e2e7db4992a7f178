"""A draft model ("draft_model" speculative decoding): a small model of the same vocabulary proposes each
request's next k tokens, greedily, and the target verifies them (speculative.py).

The draft runs on a model runner of its own, with a KV cache of its own laid out like the target's and
indexed by the same block tables: a request's draft KV sits in the blocks the scheduler gave the request.
So the draft needs slots that exist only once the step is scheduled: before scheduling it reserves k draft
tokens (placeholders, which the scheduler cuts to the step's room like any drafts), and after it fills
them in - one forward over the tokens its cache lacks, then one per further draft token.

The draft's prompt work is chunked like the target's and bounded by the same step budget: in the step that
computes a chunk of a request's prompt, the draft computes the same positions (with the decodes' drafts, in
one forward). A draft that is further behind (a prompt that came from the prefix cache or a KV load, a
preempted request, a forked sequence) catches up by at most `max_num_batched_tokens` tokens a step, shared
by all such requests, and its request gets no drafts until it is within one step of its target. So a long
prompt never stalls the decodes that share its steps: the draft never computes a whole prompt at once.

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
    greedy sampling and nothing else (no adapter either: the draft's runner has none)."""

    sampling_params = _GREEDY
    spec_token_ids: list[int] = []
    forks: list = []
    mm_placeholders = ()
    logit_bias = grammar = seed = None
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
        # Without adapters: a request with one drafts from the base draft model. Verification keeps its output
        # the adapter's own, and an adapter moves few of the argmaxes that the base draft guesses, so most of
        # its drafts are still accepted; adapters for the draft would be per draft, which nobody trains.
        self.runner = ModelRunner(replace(config, model=spec.draft, speculative=None, lora=None), num_blocks, timer)
        # The draft tokens a step may compute to catch up with the target: the target's own step budget.
        self.budget = config.scheduler.max_num_batched_tokens
        self.num_tokens_last_step = 0  # tokens the draft computed in the last step (all its forwards)
        # request -> (positions whose draft KV is computed, the blocks they are in); gone with the request.
        self._computed: weakref.WeakKeyDictionary[Request, tuple[int, tuple[int, ...]]] = weakref.WeakKeyDictionary()

    def propose(self, request: Request) -> list[int]:
        """Reserve up to k draft slots (placeholder tokens, filled in by `fill` once the step is scheduled);
        none while the draft is further behind than one step leaves it (it catches up first, chunk by chunk)."""
        if request.num_tokens - self._valid(request) > self.k + 1:
            return []
        room = min(self.k, request.max_output_tokens - request.num_output_tokens - 1)
        return [0] * max(room, 0)

    def start_step(self) -> None:
        """Nothing to do before a step's proposals (suffix_proposer.py's forgets finished requests)."""

    def fill(self, scheduled: list[ScheduledRequest], block_copies=()) -> None:
        """Compute the draft KV of the positions the target computes in this step (within the budget), and
        write the draft tokens of every scheduled request that kept some, greedy from the draft model."""
        drafting, first = [], []
        left = self.budget
        # Requests that draft first: each lacks at most the tokens of one step (propose saw to it).
        for request, num_new in sorted(scheduled, key=lambda item: not self._drafts(*item)):
            view = _DraftView(request, self._valid(request))
            if self._drafts(request, num_new):
                num = view.num_tokens - view.num_computed_tokens
                drafting.append((request, view))
            else:
                # The target's own tokens of this step (a prompt chunk, a decode without drafts), caught up to.
                end = min(request.num_computed_tokens + num_new, request.num_tokens)
                num = min(end - view.num_computed_tokens, left)
            if num > 0:
                left = max(left - num, 0)
                first.append((view, num))
        self.num_tokens_last_step = sum(num for _, num in first)
        if not first:
            if block_copies:
                self.runner.execute([], (), block_copies)
            return
        out = self.runner.execute([ScheduledRequest(v, num) for v, num in first], (), block_copies)
        active = []
        for view, num in first:
            if view.request_id not in out.failed:
                view.num_computed_tokens += num
        for request, view in drafting:
            # A failed draft forward leaves the placeholders: drafts like any others, just poor ones.
            if view.request_id in out.token_ids:
                self._take(request, view, 0, out.token_ids[view.request_id][0])
                active.append((request, view))
        for j in range(1, max((len(r.spec_token_ids) for r, _ in drafting), default=0)):
            batch = [(r, v) for r, v in active if j < len(r.spec_token_ids)]
            if not batch:
                break
            out = self.runner.execute([ScheduledRequest(v, v.num_tokens - v.num_computed_tokens) for _, v in batch])
            self.num_tokens_last_step += sum(v.num_tokens - v.num_computed_tokens for _, v in batch)
            active = []
            for request, view in batch:
                if view.request_id in out.token_ids:
                    view.num_computed_tokens = view.num_tokens
                    self._take(request, view, j, out.token_ids[view.request_id][0])
                    active.append((request, view))
        for view, _ in first:
            blocks = -(-view.num_computed_tokens // self.runner.block_size)
            self._computed[view._request] = (view.num_computed_tokens, tuple(view.block_ids[:blocks]))

    @staticmethod
    def _drafts(request: Request, num_new: int) -> bool:
        """Whether `request` was scheduled with draft tokens this step."""
        return bool(request.spec_token_ids) and request.num_computed_tokens + num_new > request.num_tokens

    @staticmethod
    def _take(request: Request, view: _DraftView, j: int, token_id: int) -> None:
        request.spec_token_ids[j] = token_id
        view.all_token_ids.append(token_id)

    def _valid(self, request: Request) -> int:
        """Leading positions of `request` whose draft KV is right: computed with the tokens the request has
        now (rejected drafts' positions are not), in blocks it still holds."""
        computed, blocks = self._computed.get(request, (0, ()))
        computed = min(computed, request.num_computed_tokens)
        held = -(-computed // self.runner.block_size)
        return computed if tuple(request.block_ids[:held]) == blocks[:held] else 0
