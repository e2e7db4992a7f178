"""Adaptive speculation: how many of its proposed draft tokens each request verifies in a step.

A draft row costs what any row costs: on a CPU, or a GPU at a large batch, the linear layers are bound by
their arithmetic, not by reading the weights, so k drafts for each of B requests make a step of B(k + 1)
rows cost up to k + 1 times one of B rows, while all a draft brings is the chance that it is accepted. So
before each step the proposals are cut to the ones that pay, and no drafts at all is one of the choices
weighed. What pays depends on whether requests are queued for a seat:

- queued: the step's expected output tokens over its expected duration (a request that ends sooner lets a
  waiting one in, so every token counts wherever it falls);
- none queued: the running requests' mean time per token (the step's duration over each request's expected
  tokens from it). Drafts that let one request of many finish sooner, with nobody to take its seat, make every
  other one wait longer for each of its tokens: a batch of requests side by side lasts as long as its slowest.

- A decode step's duration by its rows is measured (`StepCost`; steps that compute prompt tokens are left
  out: a prompt's rows cost less than a decode's or a draft's): a moving average per row count over the
  steps of the last while, interpolated between row counts seen and, above the largest, taken flat - so the
  policy tries larger steps once and from then on knows their cost.
- A request's draft j is accepted with probability a^j, a its recent acceptance rate (a run of drafts is
  accepted up to the first that differs: each verification adds its accepted drafts to the hits and the
  one rejected, if any, to the misses), starting from the engine's rate over every request's recent
  verifications.
- Positions are taken best first (the most expected tokens, or time per token taken off; either keeps each
  request's positions in order) while the rate grows; `num_speculative_tokens` stays the most a request
  verifies. The drafts are kept only if that rate beats the step's without any by MIN_GAIN: near break-even
  (a large batch, where a row costs nearly what a decode yields) what the estimate leaves out decides, and it
  is a loss - the noise of the measured costs above all. A request with no record yet has its drafts
  verified once whatever the estimate says: the engine's rate before any verification is a guess that could
  keep every draft out, and with it any record that would tell otherwise.
- Drafts never take a step's budget from prompt tokens it could compute: those of requests mid-prompt and of
  waiting requests with a seat to take (`room`). A draft that pushed a prompt to a later step would delay a
  request's start to gain a guess, and the prompt's work is to be done anyway.
- Proposing costs time too (prompt lookup: ~80 us a request a step): a request whose drafts were all cut for
  want of acceptance (not for want of room) is not asked again for 1 step, then 2, 4, ... up to
  MAX_REST_STEPS while its drafts keep being cut, and from the next step on once one is kept. Its acceptance
  changes only by verifications, so a cut would most likely be made again when its rest ends: then its first
  draft is verified anyway (a probe: one row once a rest), so that a request whose text turned to what its
  drafts foresee (the model starts to copy) is found out within a rest.
"""
from __future__ import annotations

import bisect

from epdserve.shared.engine.request import Request

# Weight of the newest step in a row count's average duration.
SMOOTHING = 0.2
# A row count not seen for this many steps is forgotten: the cost of a row grows with the context, and a
# choice the policy stopped making is tried again once in this many steps.
STALE_STEPS = 256
# A request's hits and misses decay by this much at each of its verifications (its recent text counts).
DECAY = 0.8
# The engine's, over every request's verifications: the last hundred or so. It is where a request's estimate
# starts, and what lets a request whose first verification missed (often: the first drafts of an answer
# are the worst) be tried again while the others' drafts are accepted; with a memory as short as a request's,
# a few such first misses in a row would keep every request's drafts out from then on, and nothing would be
# verified that could tell otherwise.
ENGINE_DECAY = 0.99
# The weight, in verifications, of the engine's own acceptance rate in a request's estimate.
PRIOR_WEIGHT = 2.0
# How much higher than without drafts the step's expected rate (either objective) must be for them to be kept.
MIN_GAIN = 0.1
# The longest a request whose drafts keep being cut goes without proposing, in steps.
MAX_REST_STEPS = 16


class StepCost:
    """Seconds a step takes by the rows (tokens) it computes, as measured."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._last_seen: dict[int, int] = {}
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._steps += 1
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + SMOOTHING * (seconds - old)
        self._last_seen[rows] = self._steps

    def curve(self) -> "CostCurve":
        """The current estimates, for one step's decisions."""
        fresh = sorted(r for r, seen in self._last_seen.items() if self._steps - seen < STALE_STEPS)
        return CostCurve(fresh, [self._seconds[r] for r in fresh])


class CostCurve:
    def __init__(self, rows: list[int], seconds: list[float]) -> None:
        self.rows, self.seconds = rows, seconds

    def __call__(self, rows: int) -> float | None:
        """Estimated seconds of a step of `rows`: linear between the row counts measured, flat above the
        largest (not yet measured: worth a try), the smallest's below it; None when nothing was measured."""
        if not self.rows:
            return None
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.rows):
            return self.seconds[-1]
        r0, r1, s0, s1 = self.rows[i - 1], self.rows[i], self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


class DraftPolicy:
    def __init__(self) -> None:
        self.cost = StepCost()
        self._hits = 0.0  # the engine's, over every request (decayed by ENGINE_DECAY a verification)
        self._misses = 0.0

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """`request` verified `num_drafts` drafts and `num_accepted` of them were accepted."""
        missed = 1.0 if num_accepted < num_drafts else 0.0
        request.draft_hits = DECAY * request.draft_hits + num_accepted
        request.draft_misses = DECAY * request.draft_misses + missed
        self._hits = ENGINE_DECAY * self._hits + num_accepted
        self._misses = ENGINE_DECAY * self._misses + missed

    @staticmethod
    def resting(request: Request) -> bool:
        """Whether `request` is not asked for drafts this step (counts the step)."""
        if request.draft_rest > 0:
            request.draft_rest -= 1
            return True
        return False

    def acceptance(self, request: Request) -> float:
        """The probability that `request`'s next draft is accepted, given those before it were."""
        prior = (self._hits + 1.0) / (self._hits + self._misses + 2.0)
        return (request.draft_hits + PRIOR_WEIGHT * prior) / (request.draft_hits + request.draft_misses + PRIOR_WEIGHT)

    def trim(self, proposing: list[Request], base_rows: int, base_tokens: int, room: int | None = None,
             queued: bool = True) -> None:
        """Cut the drafts (`spec_token_ids`) of the requests in `proposing` to those that pay, for a step of
        `base_rows` rows without drafts in which `base_tokens` decoding requests sample a token each, and to
        `room` drafts in all (None: as many as pay). `queued`: whether requests wait for a seat (what counts is
        the step's tokens per second); else the decoding requests' own time per token."""
        if room is not None and room <= 0:
            for request in proposing:
                request.spec_token_ids = []  # not a cut for want of acceptance: no rest
            return
        # (gain, -position, request index): a request's positions come in order, the first the likeliest and
        # the one that gains the most. The gain: the tokens it is expected to add, or with no queue the time
        # per token it is expected to take off its request's (1/t before it less 1/t after it, t the
        # request's expected tokens from the step).
        positions = []
        for i, request in enumerate(proposing):
            a, expected = self.acceptance(request), 1.0
            for j in range(1, len(request.spec_token_ids) + 1):
                value = a ** j
                positions.append((value if queued else value / (expected * (expected + value)), -j, i))
                expected += value
        positions.sort(reverse=True)
        curve = self.cost.curve()
        if curve(base_rows) is None:
            best = len(positions)  # nothing measured yet: every draft, which measures what drafts cost
        else:
            # Without a queue the rate is the requests' mean time per token, as tokens per second of the step:
            # base_tokens / (duration x mean of 1/t), so that it equals the step's rate without drafts.
            base_rate = base_tokens / curve(base_rows)
            best, best_rate = 0, base_rate
            total = float(base_tokens)  # over the decoding requests: the sum of t (queued), else of 1/t
            for d, (gain, _, _) in enumerate(positions, 1):
                total += gain if queued else -gain
                rate = (total if queued else base_tokens * base_tokens / total) / curve(base_rows + d)
                if rate > best_rate:
                    best, best_rate = d, rate
            if best_rate < base_rate * (1 + MIN_GAIN):
                best = 0
        wanted = [0] * len(proposing)  # drafts that pay, before the room cuts them
        for _, _, i in positions[:best]:
            wanted[i] += 1
        left = len(positions) if room is None else room
        best = min(best, left)
        kept = [0] * len(proposing)
        for _, _, i in positions[:best]:
            kept[i] += 1
        left -= best
        probes = set()
        for i, request in enumerate(proposing):
            if not (request.draft_hits or request.draft_misses):  # never verified: its first record
                more = min(len(request.spec_token_ids) - kept[i], left)
                kept[i], left = kept[i] + more, left - more
            elif not (kept[i] or wanted[i]) and request.draft_rest_next > 1 and left:
                kept[i], left = 1, left - 1  # cut again when its rest ran out: its first draft, a probe
                probes.add(i)
        for i, (request, n, paid) in enumerate(zip(proposing, kept, wanted)):
            request.spec_token_ids = request.spec_token_ids[:n]
            if n and i not in probes:
                request.draft_rest_next = 1
            elif not paid:  # cut for its acceptance (drafts the room cut would have paid: asked again next step)
                request.draft_rest = request.draft_rest_next
                request.draft_rest_next = min(2 * request.draft_rest_next, MAX_REST_STEPS)
