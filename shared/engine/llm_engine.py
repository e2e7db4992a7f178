"""The engine core: add requests, step, abort. Everything a service or `LLM` runs sits on this."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.config import EngineConfig
from epdserve.shared.engine.kv_cache_budget import size_kv_cache
from epdserve.shared.engine.model_runner import ModelRunner
from epdserve.shared.engine.draft_proposer import DraftModelProposer
from epdserve.shared.engine.ngram_proposer import NgramProposer
from epdserve.shared.engine.suffix_proposer import SuffixProposer
from epdserve.shared.engine.offload_connector import OffloadConnector
from epdserve.shared.engine.handoff import continue_from_peer
from epdserve.shared.engine.kv_connector import KVConnector, LoadResult, tier_stats
from epdserve.shared.engine.output_processor import OutputProcessor
from epdserve.shared.engine.queue_estimate import QueueEstimate
from epdserve.shared.engine.parallel_sampling import group_members, make_group
from epdserve.shared.engine.outputs import EngineStats, RequestOutput
from epdserve.shared.engine.kv_events import KVEventBatch
from epdserve.shared.engine.lora_manager import LoRAAdapter, LoRAManager
from epdserve.shared.engine.lora_request import LoRARequest
from epdserve.shared.engine.request import Request, RequestFailure, RequestStatus, dense_logit_bias
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.scheduler import Scheduler
from epdserve.shared.engine.step_timer import StepTimer
from epdserve.shared.engine.structured_output import GrammarCompiler
from epdserve.shared.processing.multimodal import MultiModalPlaceholder
from epdserve.shared.processing.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None, detokenize: bool = True) -> None:
        """`detokenize=False`: outputs carry token ids only (a service whose proxy turns them into text)."""
        self.config = config
        self.model_config = config.model
        logger.info("engine for %s starting: tokenizer, KV cache, kernels, weights", config.model.path)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.path)
        kv_size = size_kv_cache(config)
        num_blocks = kv_size.num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) in %s, %d bytes; %s", num_blocks,
                    config.cache.block_size, num_blocks * config.cache.block_size, config.kv_dtype_name,
                    kv_size.num_bytes, kv_size.reason)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          hash_key=config.cache.block_hash_key)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.step_timer = StepTimer(moe=config.profile_moe and config.model.moe is not None)
        self.queue_estimate = QueueEstimate()  # read by services from other threads (admission control)
        self.runner = ModelRunner(config, num_blocks, self.step_timer)
        self.proposer = self._proposer(config, num_blocks)
        # Every KV connector, asked in this order (kv_connector.py): the engine's own tier beyond the pool
        # first - bound by the front door (LLM, AsyncLLM) with the callbacks that bring its loads to the
        # engine's thread, `bind_connectors` - then those the front door adds (`add_connector`).
        self.connectors: list[KVConnector] = self.scheduler.loads.connectors
        if config.cache.kv_offloading_bytes:
            self.connectors.append(OffloadConnector.create(
                self.runner.kv_cache, config.cache.block_size, config.cache.kv_offloading_bytes,
                config.cache.kv_offloading_path, config.cache.kv_offloading_save_finished))
        self._num_own_connectors = len(self.connectors)
        self.lora_manager = None if config.lora is None else LoRAManager(config.lora, config.model,
                                                                         self.runner.model.set_lora)
        for i, (name, path) in enumerate(config.lora.modules if config.lora else ()):
            self.load_lora(LoRARequest(name, i + 1, path))  # a bad one stops the start, saying why
        self.output_processor = OutputProcessor(self.tokenizer.fast if self.tokenizer and detokenize else None)
        # Structured outputs need the vocabulary's token strings, hence a tokenizer.
        self.grammar_compiler = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer.hf, config.model.vocab_size, config.model.eos_token_ids)
        # Called on the engine's thread with the tokens each step computes (a service's metrics).
        self.on_step_tokens: Callable[[int], None] | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._due: list[RequestOutput] = []  # outputs for the next step to return (sequences a peer's token ended)
        logger.info("engine ready: %s (%s%s), %d KV blocks of %d tokens, attention backend %s, step budget %d (%s), "
                    "at most %d sequences of %d tokens, prefix caching %s, seed %d",
                    config.model.model_id, config.model.dtype,
                    ", int8 linear layers" if config.model.quantization == "int8" else "", num_blocks,
                    config.cache.block_size,
                    self.runner.attention_backend, config.scheduler.max_num_batched_tokens,
                    config.scheduler.budget_policy, config.scheduler.max_num_seqs, config.model.max_model_len,
                    "on" if config.cache.enable_prefix_caching else "off", config.seed)

    # -- requests -----------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     mm_placeholders: tuple[MultiModalPlaceholder, ...] = (), mm_embeddings: dict | None = None,
                     compiled_grammar=None, max_output_tokens: int | None = None,
                     peer_token_ids: Sequence[Sequence[int]] | None = None,
                     kv_transfer_params: object | None = None,
                     mrope_positions: Sequence[Sequence[int]] | None = None,
                     lora_request: LoRARequest | None = None, lora_adapter: LoRAAdapter | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the problem. Changes no engine state - but for an
        adapter `lora_request` names that the engine has not read yet: see `lora_request`.

        `compiled_grammar`: the params' output constraint, compiled already (else it is compiled here).
        `mm_embeddings` may lack some placeholders' items: a KV connector loads them before they are needed.
        `max_output_tokens`: stop after that many tokens whatever the params allow (a prefill's part).
        `peer_token_ids`: each sequence's tokens sampled and delivered elsewhere - the first token of each, by
        the peer that computed the prompt, or (n = 1) every token a lost stream delivered (handoff.py);
        `kv_transfer_params`: where the prompt's KV may be had from, for the KV connectors.
        `mrope_positions`: an M-RoPE model's 3-D positions of the prompt (3 rows of one position per token:
        temporal, height, width), as the prompt's builder computed them (processing/mrope.py); a text
        prompt may leave them out.
        `lora_request`: the LoRA adapter to run the request with (read from disk on first use and checked
        here; LoRAAdapterError, a ValueError, for one this model cannot serve) - reading it adds it to the
        engine's adapters, so a caller off the engine's thread passes `lora_adapter` instead: the adapter the
        engine holds under that name already (`find_lora`, or `add_lora` of what `read_lora` read). Then
        this reads only what is set once at start (the tokenizer, the model's and the engine's config) and
        the grammar compiler (thread-safe): any thread may call it."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        self._check_sampling(params)
        self._check_multimodal(len(token_ids), mm_placeholders, mm_embeddings or {})
        positions = self._mrope_positions(len(token_ids), mm_placeholders, mrope_positions)
        params = replace(params, eos_token_ids=self.model_config.eos_token_ids)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        bias = dense_logit_bias(params.logit_bias, self.model_config.vocab_size)
        if lora_adapter is not None and lora_request is not None:
            raise ValueError("pass lora_request or lora_adapter, not both")
        adapter = lora_adapter if lora_adapter is not None else self._lora_adapter(lora_request)
        lora_name, lora_key = (None, None) if adapter is None else (adapter.name, adapter.digest)
        # n > 1: the first of n sequences, the others waiting to fork from it (parallel_sampling.py).
        request = make_group(request_id, params, lambda rid, p: Request(
            rid, token_ids, p, self.model_config.max_model_len, arrival_time, cache_salt, tuple(mm_placeholders),
            text, dict(mm_embeddings or {}), self._grammar(p, compiled_grammar), bias, kv_transfer_params,
            positions, lora_name, lora_key))
        for sequence in group_members(request):
            if max_output_tokens is not None:
                sequence.max_output_tokens = min(sequence.max_output_tokens, max_output_tokens)
        if peer_token_ids is not None:
            continue_from_peer(request, peer_token_ids, self.model_config.vocab_size)
        return request

    def _lora_adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        if lora_request is None:
            return None
        self.check_lora_request(lora_request)
        return self.lora_manager.load(lora_request)

    def check_lora_request(self, lora_request: LoRARequest) -> None:
        """ValueError unless `lora_request` is one and this engine serves adapters (config only: any thread)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_manager is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but this engine serves no "
                             f"adapters (enable LoRA)")

    def _grammar(self, params: SamplingParams, compiled=None):
        """A fresh matcher for a constrained request (compiled grammars are cached); raises ValueError."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none")
        return self.grammar_compiler.new_state(params.structured_outputs, compiled)

    def add_request(self, request_id: str, prompt: PromptType | Request, params: SamplingParams | None = None,
                    **kwargs) -> Request:
        """Queue a request (made here from `prompt` unless it is one). Sequences that a peer's token ended
        already (handoff.py) finish at once: their outputs come with the next step's."""
        request = prompt if isinstance(prompt, Request) else self.make_request(request_id, prompt, params, **kwargs)
        members = group_members(request)
        if request.lora_name is not None:
            self._seat_adapter(request, members)
        self.scheduler.add_request(request)
        for sequence in members:
            self.output_processor.add_request(sequence)
        self.queue_estimate.queued_tokens += request.num_prompt_tokens
        for sequence in members if request.num_peer_tokens else ():
            self.output_processor.process_peer_tokens(sequence)
            if sequence.check_stop():
                self.scheduler.finish_at_peer_token(sequence)
            out = self.output_processor.make_output(sequence)
            if sequence.is_finished and out is not None:
                self._due.append(out)
        return request

    def _seat_adapter(self, request: Request, members: list[Request]) -> None:
        """Put the request's adapter in a slot (NoLoRASlotError when every slot is in use)."""
        adapter = self.lora_manager.adapters.get(request.lora_name)
        if adapter is None or adapter.digest != request.lora_key:
            raise ValueError(f"LoRA adapter {request.lora_name!r} was unloaded")
        in_use = {r.lora_slot for r in self.scheduler.requests.values() if r.lora_slot >= 0}
        slot = self.lora_manager.acquire(adapter, in_use)
        for sequence in members:
            sequence.lora_slot = slot

    def can_seat_lora(self, name: str) -> bool:
        """Whether a request with adapter `name` (read already) would find it a slot now."""
        in_use = {r.lora_slot for r in self.scheduler.requests.values() if r.lora_slot >= 0}
        return self.lora_manager is not None and self.lora_manager.can_seat(name, in_use)

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (LoRAAdapterError if this model cannot serve it); it takes a slot
        when a request first uses it."""
        self._lora_adapter(lora_request)

    def find_lora(self, lora_request: LoRARequest) -> LoRAAdapter | None:
        """The adapter read already under `lora_request`'s name from its path, or None (ValueError as
        `check_lora_request`)."""
        self.check_lora_request(lora_request)
        return self.lora_manager.find(lora_request)

    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter `lora_request` names (LoRAAdapterError if this model cannot serve it),
        without adding it: touches no engine state, so any thread may (a service reads adapters off the
        engine's thread, then adds them with `add_lora`)."""
        self.check_lora_request(lora_request)
        return self.lora_manager.read(lora_request)

    def add_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keep an adapter `read_lora` read under its name (in place of any kept there); returns it."""
        return self.lora_manager.add(adapter)

    def unload_lora(self, name: str) -> bool:
        """Forget an adapter (False if unknown): requests already added finish with it, new ones may not
        name it."""
        return self.lora_manager is not None and self.lora_manager.remove(name)

    def lora_adapters(self) -> list[str]:
        """The adapters loaded, by name."""
        return [] if self.lora_manager is None else self.lora_manager.names()

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
        """Placeholders in order and inside the prompt; the embeddings given of the right shape (missing ones
        are loaded by a KV connector before their positions are computed, or fail the request then)."""
        end = 0
        for ph in sorted(placeholders, key=lambda p: p.offset):
            if ph.offset < end or ph.length <= 0 or ph.offset + ph.length > num_tokens:
                raise ValueError(f"multimodal placeholder ({ph.offset}, {ph.length}) overlaps another or "
                                 f"lies outside the {num_tokens}-token prompt")
            end = ph.offset + ph.length
            emb = embeddings.get(ph.mm_hash)
            if emb is not None and tuple(emb.shape) != (ph.length, self.model_config.hidden_size):
                raise ValueError(f"item {ph.mm_hash!r} needs embeddings of shape "
                                 f"({ph.length}, {self.model_config.hidden_size})")

    def _mrope_positions(self, num_tokens: int, placeholders, positions) -> torch.Tensor | None:
        """The prompt's 3-D positions as a [3, num_tokens] tensor, checked: each in [0, num_tokens), so that
        every later token's (the largest plus one, and on) stays inside the model's length too."""
        if self.model_config.mrope_section is None:
            if positions is not None and len(positions):
                raise ValueError("mrope_positions are for models with M-RoPE; this model takes 1-D positions")
            return None
        if positions is None or not len(positions):
            if placeholders:
                raise ValueError("an image prompt for this model needs its mrope_positions (3-D positions)")
            return None
        try:
            tensor = torch.tensor([list(row) for row in positions], dtype=torch.long)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise ValueError("mrope_positions must be 3 rows of integer positions") from None
        if tuple(tensor.shape) != (3, num_tokens):
            raise ValueError(f"mrope_positions must be 3 rows of {num_tokens} positions (one per prompt token), "
                             f"got shape {list(tensor.shape)}")
        if bool((tensor < 0).any()) or int(tensor.max()) >= num_tokens:
            raise ValueError(f"mrope_positions must lie in [0, {num_tokens})")
        return tensor

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests wherever they are; every block they held returns to the pool."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            self.scheduler.release_kv(request_id)
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        # Their prompts no longer wait: an engine left idle runs no step that would recount the queue, and
        # admission control would go on refusing requests behind prompts nobody waits for.
        self.queue_estimate.queued_tokens = self.scheduler.num_queued_prompt_tokens
        return [out for r in aborted if (out := self.output_processor.make_output(r)) is not None]

    # -- KV from and for elsewhere ------------------------------------------------------------------
    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a connector kept for a finished request (a group: every sequence's); False if it
        holds none."""
        return self.scheduler.release_kv(request_id)

    def bind_connectors(self, finish: Callable[[LoadResult], None], release: Callable[[str], None]) -> None:
        """Bind the connectors the engine made itself (its offload tier, first in `connectors`) as
        `add_connector` binds the others: the front door does, once, before the first request."""
        for connector in self.connectors[:self._num_own_connectors]:
            connector.bind(finish, release)

    def add_connector(self, connector: KVConnector, finish: Callable[[LoadResult], None],
                      release: Callable[[str], None]) -> None:
        """Let `connector` feed requests and keep finished ones' KV (kv_connector.py), asked after those
        added before it. `finish(result)` ends a load, `release(request_id)` lets kept blocks go: each must
        bring its call to this engine's thread (`finish_load`, `release_kv`)."""
        connector.bind(finish, release)
        self.connectors.append(connector)

    def expect(self, request_id: str, kv_transfer_params: object) -> None:
        """A request with these `kv_transfer_params` is about to be added: every connector hears of it
        (`KVConnector.expect`)."""
        for connector in self.connectors:
            connector.expect(request_id, kv_transfer_params)

    def finish_load(self, result: LoadResult) -> list[RequestOutput]:
        """A connector's load ended (on the engine's thread); the outputs of requests that ended with it."""
        ended = self.scheduler.finish_load(result, self.model_config.hidden_size)
        return [out for r in ended if (out := self.output_processor.make_output(r)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether `step()` would compute (or deliver) anything now."""
        return self.scheduler.has_work or bool(self._due)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs that are due."""
        timer = self.step_timer
        timer.num_steps += 1
        started = time.perf_counter()
        if self.proposer is not None:
            with timer.phase("draft"):
                self._propose()
        with timer.phase("schedule"):
            sched = self.scheduler.schedule()
        # The draft policy prices rows by decode steps alone: a prompt's rows cost less than a decode's or a
        # draft's (shorter contexts, one long matrix product), and would make drafts look cheap.
        decode_only = self.proposer is not None and all(item.request.is_decoding for item in sched.scheduled)
        if self.proposer is not None:
            with timer.phase("draft"):
                self.proposer.fill(sched.scheduled, sched.block_copies)
        if sched.scheduled and self.on_step_tokens is not None:
            self.on_step_tokens(sum(item.num_new_tokens for item in sched.scheduled))
        for item in sched.scheduled:
            computed = item.request.num_computed_tokens  # before this step
            self.num_prompt_tokens += max(min(computed + item.num_new_tokens, item.request.num_prompt_tokens)
                                          - computed, 0)
        result = self.runner.execute(sched.scheduled, sched.new_block_ids, sched.block_copies)
        with timer.phase("output"):
            outputs, self._due = self._due, []
            outputs += self._fail(result.failed)
            outputs += self._fail({r.request_id: RequestFailure(
                "the request's image embeddings are missing and no connector can supply them")
                for r in sched.unservable})
            for request_id, scores in result.prompt_logprobs.items():
                request = self.scheduler.requests.get(request_id)
                if request is not None:
                    self.output_processor.process_prompt_logprobs(request_id, scores.first_token, scores.entries,
                                                                  request.prompt_token_ids)
            def on_token(request: Request, i: int) -> None:
                self.num_generation_tokens += 1
                logprobs = result.logprobs.get(request.request_id)
                stop = self.output_processor.process_token(request, logprobs[i] if logprobs else None)
                if stop is not None and not request.is_finished:
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                    request.stop_reason = stop

            for request in self.scheduler.update_from_output(sched, result.token_ids, on_token):
                out = self.output_processor.make_output(request)
                if out is not None:
                    outputs.append(out)
        seconds = time.perf_counter() - started
        self.queue_estimate.observe_step(sched.num_batched_tokens, seconds, self.scheduler.num_queued_prompt_tokens)
        if decode_only and sched.scheduled:
            self.scheduler.draft_policy.observe_step(sched.num_batched_tokens, seconds)
        return outputs

    @staticmethod
    def _proposer(config: EngineConfig, num_blocks: int) -> NgramProposer | SuffixProposer | DraftModelProposer | None:
        """Where draft tokens come from (speculative decoding), if anywhere."""
        spec = config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        if spec.method == "suffix":
            return SuffixProposer(spec)
        logger.info("draft model %s: loading it for speculative decoding", spec.draft.path)
        # Its own timer: its forward passes are the step's "draft" phase, not the target's "forward".
        return DraftModelProposer(config, num_blocks, StepTimer())

    def _propose(self) -> None:
        """Draft tokens for every running request that is decoding (its last token is all it computes), cut
        to those worth their rows (draft_policy.py)."""
        decoding, prompt_rows = [], 0
        self.proposer.start_step()
        # A resting request is not asked for drafts (draft_policy.py); a draft model's cache still follows its
        # positions (`fill` computes them for every scheduled request, drafts or not).
        rests = self.config.speculative.adaptive
        for request in self.scheduler.running:
            if request.is_decoding:
                resting = rests and self.scheduler.draft_policy.resting(request)
                request.spec_token_ids = [] if resting else self.proposer.propose(request)
                decoding.append(request)
            else:
                request.spec_token_ids = []
                prompt_rows += request.num_tokens - request.num_computed_tokens
        if not self.config.speculative.adaptive:
            return
        budget = self.config.scheduler.max_num_batched_tokens
        base_rows = len(decoding) + min(prompt_rows, budget)
        # What the step's budget leaves once every prompt token it could compute is counted: the running
        # requests' and those of waiting requests with a seat to take (draft_policy.py).
        seats = self.config.scheduler.max_num_seqs - len(self.scheduler.running)
        waiting_rows = sum(r.num_tokens - r.num_computed_tokens
                           for r in itertools.islice(self.scheduler.waiting, max(seats, 0)))
        room = budget - len(decoding) - prompt_rows - waiting_rows
        queued = len(self.scheduler.waiting) > max(seats, 0)  # some wait on after this step's seats are taken
        self.scheduler.draft_policy.trim([r for r in decoding if r.spec_token_ids], base_rows, len(decoding), room,
                                         queued)

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
        for connector in self.connectors:  # each tier's, by its name; other connectors publish none
            changes = connector.take_changes()
            if changes is not None:
                manager.events.tier_changed(connector.name, *changes)
        manager.events.seal()
        held = {c.name: hashes for c in self.connectors if (hashes := c.hashes()) is not None}
        return manager.events.since(next_seq, manager.cached_blocks, held)
    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        prompts = sched.prompt_stats.counts()
        return EngineStats(sched.num_running, len(sched.waiting), bm.num_free_blocks,
                           bm.num_blocks, bm.usage, prompts.prefix_queries, prompts.prefix_hits,
                           sched.num_preemptions, dict(sched.num_finished),
                           self.step_timer.num_steps, self.step_timer.breakdown(), self.num_prompt_tokens,
                           self.num_generation_tokens,
                           None if self.proposer is None else sched.spec_stats.counts(self.proposer.k),
                           tier_stats(self.connectors), sched.loads.num_waiting,
                           prompts.external_queries, prompts.external_hits, prompts.by_source)

    def close(self) -> None:
        """Shut every connector down, in order (`KVConnector.shutdown`: its threads); the engine itself
        holds nothing else that needs it."""
        for connector in self.connectors:
            connector.shutdown()
