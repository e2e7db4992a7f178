"""Where an engine's steps spend their time, summed per phase since the engine started.

The phases of one step, in order (draft around schedule):
    schedule   the scheduler picks requests and allocates blocks
    draft      draft tokens proposed, before and (a draft model's) after scheduling; zero without speculation
    prepare    the runner builds the varlen batch and the attention plan
    forward    the model, attention excluded (linear layers, norms, RoPE, activations, logits)
    attention  KV-cache writes and attention reads (the backend's two entry points)
    sampler    turning logits into tokens (penalties, filters, noise, logprobs)
    output     counters, stops, detokenization and handing outputs to their streams

CPU ops are synchronous, so wall time is theirs; on a GPU, kernel time lands in whichever phase first
waits for it. Timing costs two clock reads per phase and per attention call.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

PHASES = ("schedule", "draft", "prepare", "forward", "attention", "sampler", "output")


class StepTimer:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def timed(self, name: str, fn: Callable) -> Callable:
        """`fn`, its calls' time added to phase `name`."""
        seconds = self.seconds

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return run

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase; `forward` excludes the attention calls made inside it."""
        out = dict(self.seconds)
        out["forward"] = max(out["forward"] - out["attention"], 0.0)
        return out
