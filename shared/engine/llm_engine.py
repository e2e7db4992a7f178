"""The engine core: add requests, step, abort. Everything a service or `LLM` runs sits on this."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.config import EngineConfig
from epdserve.shared.engine.kv_cache_budget import size_kv_cache
from epdserve.shared.engine.model_runner import ModelRunner
from epdserve.shared.engine.output_processor import OutputProcessor
from epdserve.shared.engine.queue_estimate import QueueEstimate
from epdserve.shared.engine.parallel_sampling import group_members, make_group, ungroup
from epdserve.shared.engine.outputs import RequestOutput
from epdserve.shared.engine.kv_events import KVEventBatch
from epdserve.shared.engine.request import (MultiModalPlaceholder, Request, RequestFailure, RequestStatus,
                                            dense_logit_bias)
from epdserve.shared.engine.sampler import draw_seeded_noise
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import RemoteKVReservation, Scheduler
from epdserve.shared.engine.step_timer import StepTimer
from epdserve.shared.engine.structured_output import GrammarCompiler
from epdserve.shared.processing.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_finished: dict[str, int]  # by finish reason: stop, length, abort, error
    num_steps: int
    step_seconds: dict[str, float]  # by phase (see StepTimer)
    num_prompt_tokens: int  # prompt tokens computed here (not those found in the prefix cache or pulled)
    num_generation_tokens: int  # tokens sampled here


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None, detokenize: bool = True) -> None:
        """`detokenize=False`: outputs carry token ids only (a service whose proxy turns them into text)."""
        self.config = config
        self.model_config = config.model
        logger.info("engine for %s starting: tokenizer, KV cache, kernels, weights", config.model.path)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        kv_size = size_kv_cache(config)
        num_blocks = kv_size.num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %d bytes; %s", num_blocks, config.cache.block_size,
                    num_blocks * config.cache.block_size, kv_size.num_bytes, kv_size.reason)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.step_timer = StepTimer()
        self.queue_estimate = QueueEstimate()  # read by services from other threads (admission control)
        self.runner = ModelRunner(config, num_blocks, self.step_timer)
        self.output_processor = OutputProcessor(self.tokenizer.fast if self.tokenizer and detokenize else None)
        # Structured outputs need the vocabulary's token strings, hence a tokenizer.
        self.grammar_compiler = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer.hf, config.model.vocab_size, config.model.eos_token_ids)
        # Called on the engine's thread with the tokens each step computes (a service's metrics).
        self.on_step_tokens: Callable[[int], None] | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        logger.info("engine ready: %s (%s), %d KV blocks of %d tokens, attention backend %s",
                    config.model.model_id, config.model.dtype, num_blocks, config.cache.block_size,
                    self.runner.attention_backend)

    # -- requests -----------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     mm_placeholders: tuple[MultiModalPlaceholder, ...] = (),
                     mm_embeddings: dict | None = None, hold_kv: bool = False, compiled_grammar=None) -> Request:
        """Validate and tokenize; raises ValueError naming the problem. Changes no engine state.
        `compiled_grammar`: the params' output constraint, compiled already (else it is compiled here)."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        self._check_sampling(params)
        self._check_multimodal(len(token_ids), mm_placeholders, mm_embeddings or {})
        params = replace(params, eos_token_ids=self.model_config.eos_token_ids)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        bias = dense_logit_bias(params.logit_bias, self.model_config.vocab_size)
        # n > 1: the first of n sequences, the others waiting to fork from it (parallel_sampling.py).
        return make_group(request_id, params, lambda rid, p: Request(
            rid, token_ids, p, self.model_config.max_model_len, arrival_time, cache_salt, tuple(mm_placeholders),
            text, mm_embeddings, hold_kv, self._grammar(p, compiled_grammar), bias))

    def _grammar(self, params: SamplingParams, compiled=None):
        """A fresh matcher for a constrained request (compiled grammars are cached); raises ValueError."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none")
        return self.grammar_compiler.new_state(params.structured_outputs, compiled)

    def add_request(self, request_id: str, prompt: PromptType | Request, params: SamplingParams | None = None,
                    **kwargs) -> Request:
        request = prompt if isinstance(prompt, Request) else self.make_request(request_id, prompt, params, **kwargs)
        self.scheduler.add_request(request)
        for sequence in group_members(request):
            self.output_processor.add_request(sequence)
        self.queue_estimate.queued_tokens += request.num_prompt_tokens
        return request

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this model takes fewer than {max_len}")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _check_sampling(self, params: SamplingParams) -> None:
        """Limits that depend on the model: SamplingParams alone cannot know them."""
        vocab, max_len = self.model_config.vocab_size, self.model_config.max_model_len
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.min_tokens >= max_len:
            raise ValueError(f"min_tokens must be less than the model's length {max_len}, got {params.min_tokens}")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n must be at most the engine's max_num_seqs {self.config.scheduler.max_num_seqs}, "
                             f"got {params.n}")

    def _check_multimodal(self, num_tokens: int, placeholders, embeddings: dict) -> None:
        end = 0
        for ph in sorted(placeholders, key=lambda p: p.offset):
            if ph.offset < end or ph.length <= 0 or ph.offset + ph.length > num_tokens:
                raise ValueError(f"multimodal placeholder ({ph.offset}, {ph.length}) overlaps another or "
                                 f"lies outside the {num_tokens}-token prompt")
            end = ph.offset + ph.length
            emb = embeddings.get(ph.mm_hash)
            if emb is None or tuple(emb.shape) != (ph.length, self.model_config.hidden_size):
                raise ValueError(f"item {ph.mm_hash!r} needs embeddings of shape "
                                 f"({ph.length}, {self.model_config.hidden_size})")

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests wherever they are; every block they held returns to the pool."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            self.scheduler.release_kv(request_id)
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [out for r in aborted if (out := self.output_processor.make_output(r)) is not None]

    # -- disaggregation: KV computed here and kept for a peer, or computed by a peer ---------------
    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished `hold_kv` request kept; False if it holds none."""
        return self.scheduler.release_kv(request_id)

    def reserve_remote_kv(self, request: Request) -> RemoteKVReservation | None:
        """Set aside blocks for a request whose prompt KV a peer computed (None: no room now). The
        caller fills `reservation.block_ids` in `runner.kv_cache`, then calls `add_prefilled`."""
        return self.scheduler.reserve_remote_kv(request)

    def add_prefilled(self, request: Request, first_token_ids: int | Sequence[int]) -> list[RequestOutput]:
        """Join a reserved request, its prompt KV now in place, with the first token the peer sampled (for
        n > 1, one per sequence: the others fork from it here). Those tokens count as already delivered;
        outputs of sequences they ended are returned."""
        first_token_ids = [first_token_ids] if isinstance(first_token_ids, int) else first_token_ids
        members = group_members(request)
        for sequence in members:
            self._take_peer_noise(sequence)
        sequences = self.scheduler.add_prefilled(request, first_token_ids)
        if not sequences:  # aborted meanwhile
            return [out for m in members if (out := self.output_processor.make_output(m)) is not None]
        return self._peer_token_outputs(sequences)

    def add_recomputed(self, request: Request, first_token_ids: int | Sequence[int]) -> list[RequestOutput]:
        """Add a request whose first token a peer sampled but whose prompt KV never arrived: the prompt
        and that token are recomputed here, as after a preemption, and the request goes on exactly as it
        would have on the peer's KV (the token counts as output for penalties and limits, seeded noise
        continues). The token counts as already delivered. For n > 1 (one token per sequence) each
        sequence recomputes on its own: a fallback, where sharing the prompt is not worth the states."""
        first_token_ids = [first_token_ids] if isinstance(first_token_ids, int) else first_token_ids
        sequences = ungroup(request)
        for sequence in sequences:
            self._take_peer_noise(sequence)
            sequence.append_output_token(first_token_ids[sequence.index])
            if not sequence.check_stop():
                self.scheduler.add_request(sequence)
        return self._peer_token_outputs(sequences)

    def _take_peer_noise(self, request: Request) -> None:
        self.output_processor.add_request(request)
        if request.generator is not None and not request.sampling_params.is_greedy:
            # The peer drew one row of sampling noise for the first token: draw it too, so a seeded request
            # samples the same tokens here as it would in one engine.
            draw_seeded_noise(request.generator, self.model_config.vocab_size)

    def _peer_token_outputs(self, sequences: list[Request]) -> list[RequestOutput]:
        """Account for the peer's first tokens; the outputs of the sequences that ended at theirs."""
        outputs = []
        for sequence in sequences:
            self.output_processor.process_token(sequence, None)
            out = self.output_processor.make_output(sequence, first_token_delivered=True)
            if sequence.is_finished and out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether `step()` would compute anything now."""
        return self.scheduler.has_work

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs that are due."""
        timer = self.step_timer
        timer.num_steps += 1
        started = time.perf_counter()
        with timer.phase("schedule"):
            sched = self.scheduler.schedule()
        if sched.scheduled and self.on_step_tokens is not None:
            self.on_step_tokens(sum(item.num_new_tokens for item in sched.scheduled))
        for item in sched.scheduled:
            computed = item.request.num_computed_tokens  # before this step
            self.num_prompt_tokens += max(min(computed + item.num_new_tokens, item.request.num_prompt_tokens)
                                          - computed, 0)
        result = self.runner.execute(sched.scheduled, sched.new_block_ids, sched.block_copies)
        self.num_generation_tokens += len(result.token_ids)
        with timer.phase("output"):
            outputs = self._fail(result.failed)
            for request_id, scores in result.prompt_logprobs.items():
                request = self.scheduler.requests.get(request_id)
                if request is not None:
                    self.output_processor.process_prompt_logprobs(request_id, scores.first_token, scores.entries,
                                                                  request.prompt_token_ids)
            for request in self.scheduler.update_from_output(sched, result.token_ids):
                stop = self.output_processor.process_token(request, result.logprobs.get(request.request_id))
                if stop is not None and not request.is_finished:
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                    request.stop_reason = stop
                out = self.output_processor.make_output(request)
                if out is not None:
                    outputs.append(out)
        self.queue_estimate.observe_step(sched.num_batched_tokens, time.perf_counter() - started,
                                         self.scheduler.num_queued_prompt_tokens)
        return outputs

    def _fail(self, errors: dict[str, RequestFailure]) -> list[RequestOutput]:
        """End requests that failed on their own (their blocks return to the pool); their final outputs
        carry finish reason "error" and the cause."""
        if not errors:
            return []
        failed = self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        for request in failed:
            request.failure = errors[request.request_id]
        return [out for r in failed if (out := self.output_processor.make_output(r)) is not None]

    def kv_events(self, next_seq: int | None) -> KVEventBatch:
        """What the prefix cache gained and lost from event batch `next_seq` on; a snapshot of what it
        holds when `next_seq` is None or those batches are gone."""
        manager = self.scheduler.block_manager
        manager.events.seal()
        return manager.events.since(next_seq, manager.cached_blocks)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, len(self.scheduler.waiting), bm.num_free_blocks,
                           bm.num_blocks, bm.usage, bm.num_prefix_queries, bm.num_prefix_hits,
                           self.scheduler.num_preemptions, dict(self.scheduler.num_finished),
                           self.step_timer.num_steps, self.step_timer.breakdown(), self.num_prompt_tokens,
                           self.num_generation_tokens)
