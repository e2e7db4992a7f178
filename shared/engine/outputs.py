"""What the engine returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`, and its state (`EngineStats`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: the sampled token and the top-N alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # It continued from first tokens a peer sampled (handoff.py): its prompt was computed, and its queue and
    # prefill timed, by that peer; its `first_token_time` is its arrival here with them.
    peer_prefilled: bool = False


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set on the final output of a request whose KV a connector keeps: the blocks it holds, in order.
    kv_block_ids: list[int] | None = None
    error: str | None = None  # why the request failed (finish reason "error")
    bad_input: bool = False  # ... and whether that was the request's own doing (see RequestFailure)
    inputs_unavailable: bool = False  # ... or its inputs' source was gone (see RequestFailure)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (as in vLLM).
    # DELTA outputs carry it once, on the first output that has it.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class SpecDecodeCounts(NamedTuple):
    """Speculative decoding's counters, as vLLM names them (`spec_decode_*`), since the engine started."""

    num_drafts: int  # verification runs: one request's draft tokens in one step
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]  # [i]: runs whose draft token i + 1 was accepted


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int  # in the queue
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    # The prompts this engine prefilled, each counted once (prompt_stats.py), in tokens: looked up in the
    # prefix cache, found there.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_finished: dict[str, int]  # by finish reason: stop, length, abort, error
    num_steps: int
    step_seconds: dict[str, float]  # by phase (see StepTimer)
    num_prompt_tokens: int  # prompt tokens computed here (not those found in the prefix cache or pulled)
    num_generation_tokens: int  # tokens sampled here
    spec_decode: SpecDecodeCounts | None = None  # with speculative decoding on
    # The KV tiers beyond the pool (empty: none configured), by name: "local" (offload_connector.py).
    kv_tiers: dict[str, "KVTierStats"] = {}
    num_waiting_for_kv: int = 0  # out of the queue while a connector loads their KV or encoder outputs
    # The same prompts looked up in the KV tiers, and brought from one (0 without tiers).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Their tokens by source: local_compute, local_cache_hit, external_kv_transfer (prompt_stats.SOURCES).
    prompt_tokens_by_source: dict[str, int] = {}


# Bounds (seconds) of the restore latency histogram's buckets: a load from a tier, start to finish.
RESTORE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class KVTierStats(NamedTuple):
    """A KV tier's counters since the engine started, and what it holds now."""

    num_blocks: int  # blocks it holds now
    capacity_blocks: int
    hit_blocks: int  # blocks restored from it into the pool
    hit_tokens: int
    restored_bytes: int
    saved_blocks: int
    saved_bytes: int
    dropped_saves: int  # evicted blocks not saved (staging full, tier busy, or unreachable)
    failed_restores: int  # loads that failed (a block's checksum differed, the tier was gone): recomputed
    corrupt_blocks: int  # blocks whose bytes did not match their checksum
    restore_buckets: tuple[int, ...]  # restores per RESTORE_SECONDS_BUCKETS bound (not cumulative), then +Inf
    restore_seconds: float  # summed over restores
