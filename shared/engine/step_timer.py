"""Where an engine's steps spend their time, summed per phase since the engine started.

The phases of one step, in order (draft around schedule):
    schedule   the scheduler picks requests and allocates blocks
    draft      draft tokens proposed, before and (a draft model's) after scheduling; zero without speculation
    prepare    the runner builds the varlen batch and the attention plan
    forward    the model, attention excluded (linear layers, norms, RoPE, activations, logits)
    attention  KV-cache writes and attention reads (the backend's two entry points)
    sampler    turning logits into tokens (penalties, filters, noise, logprobs)
    output     counters, stops, detokenization and handing outputs to their streams

With `moe` (an engine built with profile_moe, on a mixture-of-experts model), the sparse MLPs' time too,
taken out of `forward` (layers/sparse_moe.py):
    moe_route     the router: gate matmul, softmax, top-k, renormalisation
    moe_dispatch  grouping the (token, expert) pairs by expert and gathering their inputs
    moe_experts   each expert's gated MLP over its tokens (its two matmuls and the activation)
    moe_combine   scaling by the router weights and adding each token's expert outputs

CPU ops are synchronous, so wall time is theirs; on a GPU, kernel time lands in whichever phase first
waits for it (the MoE phases alone synchronise, when timed). Timing costs two clock reads per phase and
per attention call; the MoE phases cost nothing unless asked for.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

PHASES = ("schedule", "draft", "prepare", "forward", "attention", "sampler", "output")
MOE_PHASES = ("moe_route", "moe_dispatch", "moe_experts", "moe_combine")


class StepTimer:
    def __init__(self, moe: bool = False) -> None:
        """`moe`: also time the sparse MLPs by part (MOE_PHASES)."""
        self.seconds = dict.fromkeys(PHASES + (MOE_PHASES if moe else ()), 0.0)
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

    def adder(self, name: str) -> Callable[[float], None]:
        """add(seconds): time measured elsewhere (the C++ decoder stack's attention calls) added to phase `name`."""
        seconds = self.seconds

        def add(s: float) -> None:
            seconds[name] += s

        return add

    @property
    def times_moe(self) -> bool:
        return MOE_PHASES[0] in self.seconds

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase; `forward` excludes the attention calls and the MoE phases made inside it."""
        out = dict(self.seconds)
        inner = out["attention"] + sum(out.get(p, 0.0) for p in MOE_PHASES)
        out["forward"] = max(out["forward"] - inner, 0.0)
        return out
