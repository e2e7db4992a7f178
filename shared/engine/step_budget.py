"""How many tokens each request computes in one step: the step's token budget, spent by a policy.

`max_num_batched_tokens` is the budget; `budget_policy` says what it bounds (SchedulerConfig):

- "prompts" (the default) bounds a step's prompt tokens and draft tokens. A decode's one token does not
  count: every running request's next token rides on top, so a step computes at most the budget plus
  `max_num_seqs` tokens. Waiting prompts are packed whole: one that does not fit in what is left waits
  for the next step - unless it is longer than the whole budget, or no prompt token is computed in this
  step yet (then it is chunked, as under "shared", so nothing waits forever).
- "shared" is vLLM V1's: running requests' tokens (a decode's one, a prefill's next chunk) and waiting
  prompts share the budget, running requests first; the waiting prompt that does not fit in what is left
  is chunked to fill the step.

Why "prompts": on a CPU a step's time grows with its tokens (a prefill step runs the linear layers at the
matmul peak: twice the tokens, twice the time), and a request's first token comes at the end of the step
that computes its prompt's last token. When many prompts arrive at once, the shared budget gives the prompts less of each
step as decodes pile up (the 64 prompts of 128 tokens at a budget of 2048: 16 prompts in the first step,
15 in the second, the 32nd request's prompt split across the second and third), and the prompt chunked at
a step's end delays every prompt that ends in that step by its chunk's time while ending nothing itself.
Counting decodes apart keeps whole prompts in every step; packing ends a step where its prompts end; and
the smaller default budget (1024 against vLLM's 2048) ends a step, and with it 8 first tokens, twice as
often. Running requests still get a token every step, so no decode waits on the burst; the step is longer
by at most one token per running request.

What it trades: in a burst, a request's TTFT plus its time for the rest of its tokens is the whole burst's
prompt work plus its own decode steps, whichever the policy. A policy only chooses whether a prompt's work
comes before a request's first token or between its later ones: "prompts" brings the median request's
first token sooner and puts more of the burst's prompts inside its decode (TPOT p50 up as TTFT p50 goes
down); "shared" the other way.
"""
from __future__ import annotations

from epdserve.shared.config import SchedulerConfig


class StepBudget:
    """One step's budget: what is left, and what each request may take of it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.total = config.max_num_batched_tokens
        self.left = self.total
        self.decodes_apart = config.budget_policy == "prompts"
        self.packs_prompts = config.budget_policy == "prompts"
        self.prompt_tokens = 0  # prompt tokens taken in this step (running prefill chunks and waiting prompts)

    @property
    def serves_running(self) -> bool:
        """Whether a running request further down the list may still get tokens in this step."""
        return self.left > 0 or self.decodes_apart

    def own_tokens(self, remaining: int) -> int:
        """Tokens of its own (not drafts) a running request with `remaining` to compute gets; 0: none."""
        if remaining == 1 and self.decodes_apart:
            return 1
        return min(remaining, self.left)

    def draft_room(self, num_own: int, remaining: int) -> int:
        """Draft tokens that may ride with a running request getting `num_own` of its `remaining` tokens:
        only where it computes all its own tokens, within what is left once they are counted."""
        if num_own != remaining:
            return 0
        return max(self.left - self._charge(num_own, remaining), 0)

    def take_running(self, num_own: int, remaining: int, num_drafts: int) -> None:
        """A running request was scheduled `num_own` of its `remaining` tokens and `num_drafts` drafts."""
        charged = self._charge(num_own, remaining)
        if remaining > 1:
            self.prompt_tokens += num_own
        self.left -= charged + num_drafts
        assert self.left >= 0

    def prompt_chunk(self, needed: int) -> int:
        """Tokens a waiting prompt with `needed` tokens to compute gets in this step; 0: it waits for the
        next (and the prompts behind it with it: they come in order)."""
        if needed <= self.left or not self.packs_prompts:
            return min(needed, self.left)
        if needed > self.total or not self.prompt_tokens:
            return self.left  # chunked either way, or nothing else would prefill: it starts now
        return 0

    def take_prompt(self, num_new: int) -> None:
        self.prompt_tokens += num_new
        self.left -= num_new
        assert self.left >= 0

    def _charge(self, num_own: int, remaining: int) -> int:
        return 0 if remaining == 1 and self.decodes_apart else num_own
