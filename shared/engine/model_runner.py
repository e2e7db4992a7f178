"""Runs one scheduled step on the model: builds the varlen batch, runs the forward pass, samples.

Owns the model weights and the KV cache, one tensor stored head-major:
    kv_cache: [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_size]
(an int8 pool's rows carry their scale: head_size + 2, kernels/int8_rows.py)
Attention layers see per-layer K and V as transposed views with the kernels' logical shape
[num_blocks, block_size, num_kv_heads, head_size]; head-major memory makes one head of one block a
contiguous run, which is what lets the CPU path gather a whole decode batch with one index_select.
A block of every layer is `kv_cache[:, :, block_id]`, the unit the transport moves between engines.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
from typing import NamedTuple

import torch

from epdserve.kernels.backend import select_attention_backend
from epdserve.shared.config import EngineConfig, kv_row_size
from epdserve.shared.models.layers.attention import AttentionMetadata
from epdserve.shared.models.layers.lora import group_by_slot
from epdserve.shared.models.layers.sparse_moe import SparseMoE
from epdserve.shared.models import model_class
from epdserve.shared.models.cpu_kernels import load_cpu_kernels
from epdserve.shared.engine.prompt_logprobs import PromptScores, prompt_span, score_prompt_spans
from epdserve.shared.engine.repeated_errors import RepeatedErrors
from epdserve.shared.engine.request import RequestFailure
from epdserve.shared.engine.sampler import SampledLogprobs, Sampler
from epdserve.shared.engine.scheduler import ScheduledRequest
from epdserve.shared.engine.speculative import Sampled, verify_drafts
from epdserve.shared.engine.step_timer import StepTimer
from epdserve.shared.models.unfilled import build_unfilled
from epdserve.shared.models.weights import checkpoint_weights, checkpoint_weights_int8

logger = logging.getLogger(__name__)
# A step that fails the same way every time logs its traceback once, then a line a minute with a count.
logger.addFilter(RepeatedErrors())


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the host, of anonymous pages, which read as zero and take memory as they are first
    written: an engine with a pool of gigabytes is ready without writing them all first (and holds only what its
    requests have used)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(num_bytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunnerOutput(NamedTuple):
    # Only requests whose computed tokens reached their length this step get tokens: one, or (a step that
    # verified draft tokens, speculative.py) the drafts accepted and the token after them.
    token_ids: dict[str, list[int]]
    logprobs: dict[str, list[SampledLogprobs]]
    # Requests that failed on their own this step (request id -> why): they get no token.
    failed: dict[str, RequestFailure]
    # Requests with prompt_logprobs whose prompt positions this step computed (chunk by chunk).
    prompt_logprobs: dict[str, PromptScores] = {}


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). Loading reads
    tensors that are then packed, quantized or dropped: freed, their pages stay in the process's heap, counted in
    its resident memory though nothing uses them (SmolLM2 from its GGUF file: 729 MB resident, 441 MB after).
    Called once the runner is built."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model(config: EngineConfig, triton: bool = False) -> torch.nn.Module:
    """The model with its weights; `triton`: the engine runs Triton's kernels (a quantized checkpoint's linear
    layers then run Triton's quantized kernel)."""
    model_config = config.model
    logger.info("loading the weights of %s: %.2f GB in %s (a few seconds per GB)", model_config.model_id,
                model_config.num_weight_bytes / 1e9, str(model_config.dtype).removeprefix("torch."))
    model = build_unfilled(lambda: model_class(model_config.architecture)(model_config), model_config.dtype,
                           config.device)
    load = checkpoint_weights_int8 if model_config.quantization == "int8" else checkpoint_weights
    model.load_weights(load(model_config.path), triton=triton)
    return model.eval().requires_grad_(False)


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int, timer: StepTimer | None = None) -> None:
        self.config = config
        self.timer = timer if timer is not None else StepTimer()
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        m = config.model
        if self.device.type == "cpu":
            # Before the weights, which the linear layers pack for their kernel; before the first request too,
            # which would otherwise wait while a ready engine compiles.
            load_cpu_kernels(m.dtype, layer_ops=True, attention=config.attention_backend in ("auto", "cpu"))
        backend = select_attention_backend(config.attention_backend, self.device)
        self.model = load_model(config, triton=backend.name == "triton")
        kv_dtype = getattr(torch, config.kv_dtype_name)
        self.kv_cache = zeroed((m.num_layers, 2, num_blocks, m.num_kv_heads, self.block_size,
                                kv_row_size(m.head_size, config.kv_dtype_name)), kv_dtype, self.device)
        backend = backend._replace(write_kv=self.timer.timed("attention", backend.write_kv),
                                   attend=self.timer.timed("attention", backend.attend))
        for i, attn in enumerate(self.model.attention_layers()):
            attn.key_cache = self.kv_cache[i, 0].transpose(1, 2)
            attn.value_cache = self.kv_cache[i, 1].transpose(1, 2)
            attn.backend = backend
        self.backend = backend
        if self.timer.times_moe:
            for module in self.model.modules():
                if isinstance(module, SparseMoE):
                    module.seconds = self.timer.seconds
        self.attention_backend = backend.name
        # LoRA by the Triton kernels where attention runs Triton's (a GPU, or the interpreter in tests).
        self.lora = None if config.lora is None else self.model.enable_lora(config.lora, backend.name == "triton")
        # The layers as one C++ call a step where they can be (the same values; SmolLM2, batch 1: 9.9 -> 7.2 ms/token).
        self.fused_layers = self.model.fuse_layers(self.timer.adder("attention"))
        # The sliding windows the layers use (None: the whole context), each planned once per step.
        self.attention_windows = tuple(dict.fromkeys(attn.sliding_window for attn in self.model.attention_layers()))
        # The CPU path keeps the decode batch's K/V contiguous across steps, within the pool's own size.
        self.decode_mirror = None
        if backend.name == "torch" and self.device.type == "cpu":
            from epdserve.kernels.decode_mirror import DecodeMirror

            self.decode_mirror = DecodeMirror(self.kv_cache.numel() * 4)
        self.sampler = Sampler(config.seed)
        return_freed_memory()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], new_block_ids: list[int] = (),
                block_copies: list[tuple[int, int]] = ()) -> ModelRunnerOutput:
        """Run one step. A failure is pinned on the request that caused it: the others still get their
        tokens and the caller fails only the requests in `failed`. `block_copies`: (source, destination)
        blocks to copy first (copy-on-write of a block that forked sequences share)."""
        if new_block_ids:  # as bytes: zero bytes are 0.0 in every dtype, and torch fills no float8 on CPU
            self.kv_cache.view(torch.uint8).index_fill_(2, torch.tensor(new_block_ids, device=self.device), 0)
        if block_copies:
            sources, destinations = (torch.tensor(ids, device=self.device) for ids in zip(*block_copies))
            self.kv_cache[:, :, destinations] = self.kv_cache[:, :, sources]
        if not scheduled:
            return ModelRunnerOutput({}, {}, {})
        try:
            return self._execute(scheduled)
        except Exception as exc:
            if self.decode_mirror is not None:
                self.decode_mirror.reset()  # it may hold part of the failed step
            if len(scheduled) == 1:
                logger.exception("request %s failed in the model", scheduled[0].request.request_id)
                return ModelRunnerOutput({}, {}, {scheduled[0].request.request_id:
                                                  RequestFailure(f"{type(exc).__name__}: {exc}")})
            # Which request was it? Run each alone: recomputing a token rewrites the same KV slots with
            # the same values, so the requests that are fine end up exactly as if the step had worked.
            logger.exception("a step of %d requests failed; running them one at a time", len(scheduled))
            outputs = [self.execute([item]) for item in scheduled]
            return ModelRunnerOutput(*({k: v for out in outputs for k, v in out[i].items()}
                                       for i in range(len(ModelRunnerOutput._fields))))

    def _execute(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        with self.timer.phase("prepare"):
            input_ids, positions, meta, sample_rows, sample_requests, spans, spec = self._prepare(scheduled)
        with self.timer.phase("forward"):
            hidden = self.model(input_ids, positions, meta, self._multimodal_embeds(scheduled, input_ids))
            prompt_logprobs = score_prompt_spans(hidden, spans, self.model.compute_logits) if spans else {}
            if not sample_requests:
                return ModelRunnerOutput({}, {}, {}, prompt_logprobs)
            logits = self.model.compute_logits(hidden[sample_rows]).cpu()
        with self.timer.phase("sampler"):
            # Every request's next position first, as without drafts; then the draft positions, in order.
            first = self._sample(logits[:len(sample_requests)], sample_requests)
            token_ids = {rid: [token_id] for rid, token_id in first.token_ids.items()}
            logprobs = {rid: [lp] for rid, lp in first.logprobs.items()}
            if spec:
                verify_drafts(logits, spec, token_ids, logprobs, self._sample)
            return ModelRunnerOutput(token_ids, logprobs, first.failed, prompt_logprobs)

    def _sample(self, logits: torch.Tensor, requests: list) -> Sampled:
        failed: dict[str, RequestFailure] = {}
        try:
            outs = [(requests, self.sampler(logits, requests))]
        except Exception:
            # One request's parameters broke the batch: sample row by row so only that one fails (a seeded
            # request draws the same noise again: it depends on its seed and position only).
            logger.exception("sampling a batch of %d failed; sampling its rows one at a time", len(requests))
            outs = []
            for i, request in enumerate(requests):
                try:
                    outs.append(([request], self.sampler(logits[i:i + 1], [request])))
                except Exception as exc:
                    failed[request.request_id] = RequestFailure(f"sampling failed: {type(exc).__name__}: {exc}")
        ids, lps = {}, {}
        for rows, out in outs:
            for j, (request, token_id, logprobs) in enumerate(zip(rows, out.token_ids, out.logprobs)):
                if j in out.failed:  # the request's own output constraint left it no token
                    failed[request.request_id] = RequestFailure(out.failed[j], bad_input=True)
                    continue
                ids[request.request_id] = token_id
                if logprobs is not None:
                    lps[request.request_id] = logprobs
        return Sampled(ids, lps, failed)

    def _multimodal_embeds(self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with encoder outputs written over the image placeholders this step computes;
        None when the step covers no placeholder (the model then embeds input_ids itself)."""
        embeds = None
        row = 0
        for request, num_new in scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            for ph in request.mm_placeholders:
                lo, hi = max(start, ph.offset), min(end, ph.offset + ph.length)
                if lo >= hi:
                    continue
                if embeds is None:
                    embeds = self.model.embed(input_ids)
                source = request.mm_embeddings[ph.mm_hash]  # [ph.length, hidden_size]
                embeds[row + lo - start:row + hi - start] = source[lo - ph.offset:hi - ph.offset].to(embeds)
            row += num_new
        return embeds

    def _prepare(self, scheduled: list[ScheduledRequest]):
        bs = self.block_size
        token_ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_requests = []
        spans = []  # prompt tokens scored this step, for requests that want prompt logprobs
        draft_rows: list[tuple[object, int]] = []  # (request, its row after its first draft), rows in token order
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            if (span := prompt_span(request, start, end, len(token_ids))) is not None:
                spans.append(span)
            token_ids.extend(request.all_token_ids[start:end])
            # Draft tokens follow the request's own (the scheduler gives them room only after all of those).
            num_drafts = max(end - request.num_tokens, 0)
            token_ids.extend(request.spec_token_ids[:num_drafts])
            starts.append(start)
            q_lens.append(num_new)
            tables.append(request.block_ids)
            if end - num_drafts == request.num_tokens:
                last = len(token_ids) - 1 - num_drafts
                # Sequences waiting to fork from this one sample their first tokens from the same row.
                sample_rows.extend([last] * (1 + len(request.forks)))
                sample_requests.extend([request, *request.forks])
                if num_drafts:
                    draft_rows.append((request, last + 1))
        # Draft positions' rows go after every request's first row: [first rows..., draft rows...].
        spec = []
        for request, row in draft_rows:
            spec.append((request, len(sample_rows)))
            sample_rows.extend(range(row, row + len(request.spec_token_ids)))
        num_seqs = len(scheduled)
        max_blocks = max(len(t) for t in tables)
        # Rows are padded with the sequence's own last block: padding is never attended to, but a kernel
        # that gathers whole rows then reads only this request's data.
        block_tables = torch.tensor([t + t[-1:] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
        if all(q == 1 for q in q_lens):  # a token each (decodes): no repeats (repeat_interleave costs ~40 us)
            seq_idx = torch.arange(num_seqs)
            positions = torch.tensor(starts, dtype=torch.long)
        else:
            seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
            # Position of each new token = its sequence's computed count + its index within the chunk.
            positions = torch.tensor(starts, dtype=torch.long)[seq_idx] + (
                torch.arange(len(token_ids)) - query_start_loc[:-1].long()[seq_idx])
        slot_mapping = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        seq_lens = torch.tensor(starts, dtype=torch.int32) + q_lens_t
        dev = self.device
        if self.lora is not None:
            slots = torch.tensor([request.lora_slot for request, _ in scheduled])
            batch = group_by_slot(slots[seq_idx], padded=not (self.lora.triton or self.lora.invariant))
            self.lora.batch = None if batch is None else batch._replace(token_indices=batch.token_indices.to(dev))
        meta = AttentionMetadata(slot_mapping.to(dev), block_tables.to(dev), seq_lens.to(dev), query_start_loc.to(dev))
        if self.backend.plan is not None:
            m = self.config.model
            extra = {}
            if self.decode_mirror is not None:
                extra = dict(mirror=self.decode_mirror, seq_ids=tuple(r.request_id for r, _ in scheduled),
                             num_layers=m.num_layers, head_size=m.head_size)
            for window in self.attention_windows:
                # The first window's plan begins the mirror's step; the others share its work.
                base = {"base": next(iter(meta.plans.values()))} if meta.plans else extra
                meta.plans[window] = self.backend.plan(meta.block_tables, meta.seq_lens, meta.query_start_loc, bs,
                                                       m.num_kv_heads, window, **base)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        if self.config.model.mrope_section is not None:  # the rotary positions are 3-D; the slots stay 1-D
            positions = torch.cat([request.rope_positions(request.num_computed_tokens,
                                                          request.num_computed_tokens + num_new)
                                   for request, num_new in scheduled], dim=1)
        return (input_ids, positions.to(dev), meta, torch.tensor(sample_rows, device=dev), sample_requests, spans,
                spec)
