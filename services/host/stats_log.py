"""An engine service's periodic stats line, as vLLM's:

    decode decode-0: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 48.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 1.2%, Prefix cache hit rate: 37.5%

With speculative decoding on, the line ends with its draft acceptance rate and mean acceptance length.
Throughputs are over the time since the previous line; the hit rate over every prompt token looked up
since the engine started. A line comes only when the engine stepped, or its queues changed, since the
previous one: an idle engine stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from epdserve.shared.engine import EngineStats

logger = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, name: str, stats: Callable[[], EngineStats]) -> None:
        """`name`: the engine's, first on each line; `stats()`: its state now."""
        self.name, self.stats = name, stats
        self._last = stats()
        self._last_time = time.monotonic()

    def line(self) -> str | None:
        """The line for the time since the previous call, or None if nothing happened in it."""
        now, s, last, since = time.monotonic(), self.stats(), self._last, self._last_time
        self._last, self._last_time = s, now
        if (s.num_steps, s.num_running, s.num_waiting) == (last.num_steps, last.num_running, last.num_waiting):
            return None
        seconds = max(now - since, 1e-9)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (f"{self.name}: Avg prompt throughput: {(s.num_prompt_tokens - last.num_prompt_tokens) / seconds:.1f} "
                f"tokens/s, Avg generation throughput: "
                f"{(s.num_generation_tokens - last.num_generation_tokens) / seconds:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {s.kv_cache_usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}" + _spec_decode(s, last))

    async def run(self, interval: float) -> None:
        """Log a line every `interval` seconds when there is one, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            line = self.line()
            if line is not None:
                logger.info(line)


def _spec_decode(s: EngineStats, last: EngineStats) -> str:
    """Speculative decoding over the interval, as vLLM reports it: draft tokens accepted, and tokens a
    verification run yields on average (its accepted drafts and the token after them)."""
    if s.spec_decode is None or s.spec_decode.num_drafts == last.spec_decode.num_drafts:
        return ""
    drafts = s.spec_decode.num_drafts - last.spec_decode.num_drafts
    proposed = s.spec_decode.num_draft_tokens - last.spec_decode.num_draft_tokens
    accepted = s.spec_decode.num_accepted_tokens - last.spec_decode.num_accepted_tokens
    return (f", Spec decode draft acceptance rate: {accepted / max(proposed, 1):.1%}, "
            f"Mean acceptance length: {1 + accepted / drafts:.2f}")
