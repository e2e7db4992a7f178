"""What one engine of a model does on this hardware: the measurements `epdserve plan` predicts from.

    prefill   (prompt tokens, seconds): one prompt alone, from its arrival to its first token
    decode    (batch, seconds): one decode step of that many requests together, each `context_len` tokens in
    encode    seconds for one image through the vision tower (a multimodal model; None otherwise)

Each measured on a fresh engine built from the same options a service would get, with its prefix cache off
(every prompt computed) and token ids drawn from a fixed seed. Between measured points a quantity is
interpolated linearly; past the last point, extrapolated along the last two (a prompt's time grows with its
length, a step's with its batch).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from epdserve.shared.engine import SamplingParams

DECODE_STEPS = 16  # steps timed per decode batch, once every request of it is decoding
REPEATS = 3  # each prefill length, the median taken


@dataclass(frozen=True)
class EngineProfile:
    model: str
    threads: int
    context_len: int  # the decode steps' context
    max_num_seqs: int  # the engine's largest batch
    prefill: tuple[tuple[int, float], ...]
    decode: tuple[tuple[int, float], ...]
    encode: float | None = None

    def prefill_seconds(self, tokens: float) -> float:
        return _interpolate(self.prefill, tokens)

    def step_seconds(self, batch: float) -> float:
        return _interpolate(self.decode, max(batch, 1.0))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        data = json.loads(Path(path).read_text())
        try:
            points = {key: tuple(sorted((float(x), float(y)) for x, y in data[key])) for key in ("prefill", "decode")}
            profile = cls(**{**data, **points})
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{path} is not a profile `epdserve plan --save-profile` wrote: {exc}") from None
        if not all(points.values()) or any(x <= 0 or y <= 0 for xy in points.values() for x, y in xy):
            raise ValueError(f"{path}: a profile needs measured prefill and decode points, each above 0")
        return profile


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    if len(points) == 1:  # one point: proportional (a prompt's tokens, a step's rows)
        return points[0][1] * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)
    raise AssertionError("unreachable")


async def measure(llm, model: str, vocab_size: int, threads: int, max_num_seqs: int, step_tokens: int,
                  prompt_lens: Sequence[int], batches: Sequence[int], context_len: int, image_encoder=None,
                  seed: int = 0) -> EngineProfile:
    """Profile `llm` (an AsyncLLM, otherwise idle, built on this event loop; `step_tokens`: its step's prompt
    budget) and `image_encoder` (an ImageEncoder, for a multimodal model)."""
    rng = random.Random(seed)

    def prompt(n: int) -> dict:
        # Clear of the first and last hundred ids, where tokenizers keep their special tokens.
        return {"prompt_token_ids": [rng.randrange(100, vocab_size - 100) for _ in range(n)]}

    async def one(n: int, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for out in llm.generate(prompt(n), params):
            last = out
        return last

    await one(min(prompt_lens), 2)  # warm-up: first calls pay for allocations and kernel choices
    prefill = []
    for n in sorted(set(prompt_lens)):
        seconds = []
        for _ in range(REPEATS):
            out = await one(n, 1)
            seconds.append(out.metrics.first_token_time - out.metrics.arrival_time)
        prefill.append((n, statistics.median(seconds)))
    decode = [(batch, await _decode_step(llm, batch, context_len, step_tokens, prompt))
              for batch in sorted(set(batches))]
    encode = None
    if image_encoder is not None:
        import numpy as np

        pixels = np.random.default_rng(seed).integers(0, 256, (336, 336, 3), dtype=np.uint8)
        image_encoder.embed(pixels)  # warm-up
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            image_encoder.embed(pixels)
            seconds.append(time.perf_counter() - start)
        encode = statistics.median(seconds)
    return EngineProfile(model=model, threads=threads, context_len=context_len, max_num_seqs=max_num_seqs,
                         prefill=tuple(prefill), decode=tuple(decode), encode=encode)


async def _decode_step(llm, batch: int, context_len: int, step_tokens: int, prompt) -> float:
    """Seconds per step of `batch` requests decoding together: the median gap between one request's tokens once
    every request of the batch has its first (before that, steps also compute the later prompts)."""
    # Enough tokens for the first request to outlast the steps that compute the others' prompts, and then some.
    max_tokens = -(-batch * context_len // step_tokens) + DECODE_STEPS + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [prompt(context_len) for _ in range(batch)]
    started, every_one_started, times = set(), asyncio.Event(), []

    async def one(i: int) -> None:
        async for _ in llm.generate(prompts[i], params):
            if i not in started:
                started.add(i)
                if len(started) == batch:
                    every_one_started.set()
            elif i == 0 and every_one_started.is_set():
                times.append(time.perf_counter())
                if len(times) > DECODE_STEPS:
                    return  # leaving the stream aborts the request

    tasks = [asyncio.create_task(one(i)) for i in range(batch)]
    try:
        await tasks[0]
    finally:
        for task in tasks[1:]:  # cancelled, each leaves its stream: the request is aborted
            task.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
    if len(times) < 2:
        raise RuntimeError(f"a decode batch of {batch} gave {len(times)} timed steps: the engine ended its requests early")
    return statistics.median(b - a for a, b in zip(times, times[1:]))
