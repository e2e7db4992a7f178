"""Sends a dataset to an OpenAI-compatible endpoint and records what each streamed response looked like.

Arrivals follow `vllm bench serve`: at rate r, inter-arrival gaps are gamma(shape=burstiness,
scale=1/(r * burstiness)) (burstiness 1 = a Poisson process), or exactly 1/r with `arrival="fixed"` (or
burstiness inf), scaled so that n requests take n/r seconds; rate inf sends everything at once. `max_concurrency` caps requests in flight; a request's clock starts
when it is actually sent, and the wait for a slot before that is its client queue time. Turns of a
multi-turn conversation wait for the previous turn's reply, which becomes part of their prompt.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from epdserve.services.bench.datasets import SampleRequest
from epdserve.services.bench.metrics import RequestOutput


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how requests go. `extra_body` is merged into every request body (sampling options...)."""

    api_url: str
    model: str
    chat: bool
    ignore_eos: bool = True
    headers: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    request_id_prefix: str = "bench-"
    verify_tls: bool = True


@dataclass(frozen=True, slots=True)
class LoadShape:
    request_rate: float = math.inf
    burstiness: float = 1.0
    arrival: str = "poisson"  # or "fixed": evenly spaced requests
    max_concurrency: int | None = None
    seed: int = 0


def arrival_times(num_requests: int, shape: LoadShape) -> list[float]:
    """Seconds after the start at which each request is due, as `vllm bench serve` schedules them: each
    request waits its gap after the one before (the first, after the start), the gaps drawn from numpy's
    legacy generator seeded with the run's seed (the draws vLLM makes after its np.random.seed), then scaled
    to add up to exactly num_requests / rate, so that a run's length does not depend on the seed."""
    if math.isinf(shape.request_rate):
        return [0.0] * num_requests
    if shape.request_rate <= 0:
        raise ValueError("request rate must be positive (or inf)")
    if num_requests == 0:
        return []
    if shape.arrival == "fixed" or math.isinf(shape.burstiness):
        gaps = np.full(num_requests, 1.0 / shape.request_rate)
    else:
        if shape.burstiness <= 0:
            raise ValueError("burstiness must be positive")
        theta = 1.0 / (shape.request_rate * shape.burstiness)
        gaps = np.random.RandomState(shape.seed).gamma(shape.burstiness, theta, num_requests)
    due = np.cumsum(gaps)
    return (due * (num_requests / shape.request_rate / due[-1])).tolist()


class Conversations:
    """The message history of each multi-turn conversation, and which turns have finished."""

    def __init__(self) -> None:
        self.history: dict[int, list[dict]] = {}
        self.finished: dict[tuple[int, int], asyncio.Event] = {}
        self.failed: set[int] = set()

    def event(self, conversation_id: int, turn: int) -> asyncio.Event:
        return self.finished.setdefault((conversation_id, turn), asyncio.Event())

    async def wait_for_previous(self, sample: SampleRequest) -> None:
        if sample.turn:
            await self.event(sample.conversation_id, sample.turn - 1).wait()

    def messages(self, sample: SampleRequest) -> list[dict]:
        return self.history.get(sample.conversation_id, []) + sample.messages

    def finish(self, sample: SampleRequest, output: RequestOutput) -> None:
        if output.success:
            self.history[sample.conversation_id] = self.messages(sample) + [
                {"role": "assistant", "content": output.generated_text}]
        else:
            self.failed.add(sample.conversation_id)
        self.event(sample.conversation_id, sample.turn).set()


def request_body(endpoint: Endpoint, sample: SampleRequest, messages: list[dict] | None) -> dict:
    body: dict = {"model": endpoint.model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.chat:
        body["messages"] = messages if messages is not None else [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        if sample.prompt is None:
            raise ValueError("this dataset needs a chat endpoint (/v1/chat/completions)")
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    return body | endpoint.extra_body


def _is_token_chunk(choice: dict, chat: bool) -> tuple[bool, str]:
    """(whether a streamed choice marks new tokens, its text).

    A chat stream's role announcement and a closing chunk with a finish reason but no text carry no
    token; a chunk whose text the server held back (an incomplete character) still does.
    """
    finished = choice.get("finish_reason") is not None
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        return bool(text) or (not finished and "role" not in delta), text
    text = choice.get("text") or ""
    return bool(text) or not finished, text


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, body: dict, prompt_len: int,
                       request_id: str, t0: float, count_tokens=None) -> RequestOutput:
    """Stream one request; every failure is recorded in the output, never raised."""
    out = RequestOutput(prompt_len=prompt_len)
    headers = endpoint.headers | {"X-Request-Id": request_id}
    texts: list[str] = []
    start = time.perf_counter()
    out.start_time = start - t0
    last = start
    first_seen = False
    usage = None
    try:
        async with client.stream("POST", endpoint.api_url, json=body, headers=headers,
                                 timeout=endpoint.timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                out.error = f"HTTP {response.status_code}: {detail}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return out
                usage = chunk.get("usage") or usage
                out.trace = chunk.get("epdserve_trace") or out.trace  # an epdserve proxy's, in the last chunk
                choices = chunk.get("choices")
                if choices:
                    is_token, text = _is_token_chunk(choices[0], endpoint.chat)
                    texts.append(text)
                    if is_token:
                        if not first_seen:
                            first_seen, out.ttft = True, now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                out.latency = now - start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.generated_text = "".join(texts)
    if not first_seen:
        out.error = "the stream ended without a token"
        return out
    num_chunks = 1 + len(out.itl)
    if usage:
        out.prompt_len = usage.get("prompt_tokens") or prompt_len
        out.output_len = usage.get("completion_tokens") or num_chunks
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        out.output_len = count_tokens(out.generated_text) if count_tokens else num_chunks
    out.success = True
    return out


class Progress:
    """tqdm on stderr when installed, else one plain line per tenth of the requests."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(self.total // 10, 1) == 0):
            print(f"{self.desc}: {self.done}/{self.total} requests", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_load(endpoint: Endpoint, samples: list[SampleRequest], shape: LoadShape, warmups: list[SampleRequest],
                   progress: bool = True, count_tokens=None) -> tuple[list[RequestOutput], float]:
    """Send every sample on schedule; (outputs in dataset order, benchmark duration in seconds)."""
    limit = shape.max_concurrency or None
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                               timeout=endpoint.timeout_s, verify=endpoint.verify_tls)
    async with client:
        for i, sample in enumerate(warmups):
            out = await send_request(client, endpoint, request_body(endpoint, sample, sample.messages),
                                     sample.prompt_len, f"{endpoint.request_id_prefix}warmup-{i}", time.perf_counter())
            if not out.success:
                raise RuntimeError(f"warm-up request failed: {out.error}")

        slots = asyncio.Semaphore(limit) if limit else None
        conversations = Conversations()
        bar = Progress(len(samples), progress, "requests")

        async def one(i: int, sample: SampleRequest) -> RequestOutput:
            if sample.conversation_id is not None:
                await conversations.wait_for_previous(sample)
                if sample.conversation_id in conversations.failed:
                    out = RequestOutput(prompt_len=sample.prompt_len, turn=sample.turn,
                                        error="an earlier turn of the conversation failed")
                    conversations.finish(sample, out)
                    bar.update()
                    return out
            messages = conversations.messages(sample) if sample.conversation_id is not None else sample.messages
            body = request_body(endpoint, sample, messages)
            ready = time.perf_counter() - t0  # due, and its conversation's earlier turn answered
            if slots is not None:
                await slots.acquire()
            try:
                out = await send_request(client, endpoint, body, sample.prompt_len,
                                         f"{endpoint.request_id_prefix}{i}", t0, count_tokens)
            finally:
                if slots is not None:
                    slots.release()
            out.turn = sample.turn
            out.queue_time = max(out.start_time - ready, 0.0)
            if sample.conversation_id is not None:
                conversations.finish(sample, out)
            bar.update()
            return out

        due = arrival_times(len(samples), shape)
        tasks = []
        t0 = time.perf_counter()
        for i, (sample, at) in enumerate(zip(samples, due)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, sample)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(outputs), duration
