"""How long a request arriving now would wait before its prompt starts: the prompt tokens queued ahead of it
over the rate the engine computes tokens at.

The engine's thread updates it after each step and each abort; a service's event loop reads it (plain attribute reads,
which the GIL keeps whole) to refuse a request that would only wait in silence (admission control). The
rate is learnt from steps that computed a prefill's worth of tokens: a step of a few decodes says little
about how fast prompts go.
"""
from __future__ import annotations

# Steps with fewer tokens than this do not update the rate.
MIN_TOKENS_FOR_RATE = 64
# Weight of the newest step in the rate's moving average.
SMOOTHING = 0.3


class QueueEstimate:
    def __init__(self) -> None:
        self.queued_tokens = 0  # prompt tokens still to compute, of requests waiting or part-way through
        # Prompt tokens of requests handed to the engine's thread and not yet taken in: a burst that arrives
        # during a step counts before that step ends. Changed under the caller's lock.
        self.submitted_tokens = 0
        self.tokens_per_second: float | None = None  # None until a large enough step was seen

    def observe_step(self, num_tokens: int, seconds: float, queued_tokens: int) -> None:
        """A step computed `num_tokens` in `seconds`; `queued_tokens` remain queued after it."""
        self.queued_tokens = queued_tokens
        if num_tokens >= MIN_TOKENS_FOR_RATE and seconds > 0:
            rate = num_tokens / seconds
            previous = self.tokens_per_second
            self.tokens_per_second = rate if previous is None else SMOOTHING * rate + (1 - SMOOTHING) * previous

    @property
    def seconds(self) -> float:
        """Estimated wait of a request arriving now (0 while the rate is unknown or nothing is queued)."""
        rate, queued = self.tokens_per_second, self.queued_tokens + self.submitted_tokens
        return queued / rate if rate and queued else 0.0
