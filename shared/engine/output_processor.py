"""Turns engine progress into `RequestOutput`s: detokenization, stop strings, logprobs, output kinds.

The n sequences of a request with n > 1 have a state each and answer as one request: outputs carry the
group's id, each completion its sequence's index, and `finished` only once every sequence has.
"""
from __future__ import annotations

import dataclasses
import time

from tokenizers import Tokenizer

from epdserve.shared.processing.detokenizer import IncrementalDetokenizer
from epdserve.shared.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampler import SampledLogprobs
from epdserve.shared.engine.sampling_params import RequestOutputKind


class _RequestState:
    __slots__ = ("detokenizer", "logprobs", "cumulative_logprob", "num_sent_tokens", "num_sent_chars", "metrics",
                 "prompt_logprobs", "prompt_logprobs_sent")

    def __init__(self, detokenizer: IncrementalDetokenizer | None, arrival_time: float) -> None:
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.num_sent_tokens = 0  # for DELTA outputs
        self.num_sent_chars = 0
        self.metrics = RequestMetrics(arrival_time)
        # [None] + one entry per prompt token scored so far, when the request asked for prompt logprobs.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_logprobs_sent = False  # for DELTA outputs


class _GroupState:
    __slots__ = ("num_unfinished", "latest")

    def __init__(self) -> None:
        self.num_unfinished = 0
        self.latest: dict[int, CompletionOutput] = {}  # sequence index -> its latest completion


class OutputProcessor:
    """Owns the per-request output state; the engine tells it about new tokens and endings."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        # tokenizer: the fast `tokenizers.Tokenizer`; None = no text (token ids only).
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self.groups: dict[str, _GroupState] = {}  # group id -> its sequences' common state (n > 1)

    def add_request(self, request: Request) -> None:
        sp = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, sp.stop, sp.include_stop_str_in_output,
                                           sp.skip_special_tokens)
        state = self.states[request.request_id] = _RequestState(detok, request.arrival_time)
        if request.group_id != request.request_id:
            self.groups.setdefault(request.group_id, _GroupState()).num_unfinished += 1
        if sp.prompt_logprobs is not None:
            state.prompt_logprobs = [None]

    def process_prompt_logprobs(self, request_id: str, first_token: int, entries: list[SampledLogprobs],
                                token_ids: list[int]) -> None:
        """Record prompt tokens first_token, first_token + 1, ... scored by a step; positions scored
        before (a recompute after preemption) keep their first score."""
        state = self.states.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return
        known = len(state.prompt_logprobs)
        for index, lp in enumerate(entries[max(known - first_token, 0):], start=max(known, first_token)):
            if index != len(state.prompt_logprobs):
                break  # a gap cannot happen: chunks come in order
            state.prompt_logprobs.append(self._logprob_entry(token_ids[index], lp))

    def process_peer_tokens(self, request: Request) -> None:
        """Account for the tokens a peer sampled for a request just added (handoff.py): they were delivered
        with their logprobs, so they count as sent, each with an empty logprobs entry that keeps later
        deltas in line."""
        state = self.states[request.request_id]
        for token_id in request.output_token_ids:
            self._account(request, state, token_id, None)
        state.metrics.peer_prefilled = True
        state.num_sent_tokens = request.num_peer_tokens
        state.num_sent_chars = len(state.detokenizer.text) if state.detokenizer else 0

    def process_token(self, request: Request, logprobs: SampledLogprobs | None) -> str | None:
        """Account for the request's newest token; return a stop string it completed, if any."""
        return self._account(request, self.states[request.request_id], request.output_token_ids[-1], logprobs)

    def _account(self, request: Request, state: _RequestState, token_id: int,
                 logprobs: SampledLogprobs | None) -> str | None:
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
            state.metrics.first_scheduled_time = request.first_scheduled_time
        if logprobs is None and request.sampling_params.logprobs is not None:
            state.logprobs.append({})  # a peer's token
        elif logprobs is not None:
            state.cumulative_logprob += logprobs.logprob
            state.logprobs.append(self._logprob_entry(token_id, logprobs))
        if state.detokenizer is None:
            return None
        return state.detokenizer.add_token(token_id, request.num_output_tokens >= request.sampling_params.min_tokens)

    def _logprob_entry(self, token_id: int, logprobs: SampledLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position shape: the top alternatives by rank, and the token itself."""
        entry = {tid: Logprob(lp, rank + 1, self._decode_one(tid)) for rank, (tid, lp) in enumerate(logprobs.top)}
        entry[token_id] = Logprob(logprobs.logprob, logprobs.rank, self._decode_one(token_id))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def make_output(self, request: Request) -> RequestOutput | None:
        """The output to deliver now for this request, by its output kind; None if nothing is due."""
        state = self.states.get(request.request_id)
        if state is None:  # ended before it was ever added here (e.g. aborted while its KV was in flight)
            return None
        sp = request.sampling_params
        finished = request.is_finished
        if sp.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = state.detokenizer.visible_text(finished) if state.detokenizer else ""
        token_ids = request.output_token_ids
        logprobs = state.logprobs if sp.logprobs is not None else None
        if sp.output_kind == RequestOutputKind.DELTA:
            start_tok, start_chr = state.num_sent_tokens, state.num_sent_chars
            if len(token_ids) == start_tok and len(text) == start_chr and not finished:
                return None
            state.num_sent_tokens, state.num_sent_chars = len(token_ids), len(text)
            token_ids, text = token_ids[start_tok:], text[start_chr:]
            logprobs = logprobs[start_tok:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(
            index=request.index, text=text, token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob if sp.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
        )
        if finished:
            state.metrics.finished_time = time.monotonic()
            del self.states[request.request_id]
        held = list(request.block_ids) if finished and request.kv_held and request.block_ids else None
        failure = request.failure
        output = RequestOutput(request.group_id, request.prompt, request.prompt_token_ids, [completion],
                               finished, max(request.num_cached_tokens, 0), state.metrics, held,
                               failure.message if failure else None, bool(failure and failure.bad_input),
                               bool(failure and failure.inputs_unavailable),
                               self._take_prompt_logprobs(state, sp.output_kind))
        return output if request.group_id == request.request_id else self._group_output(request, output)

    def _group_output(self, request: Request, output: RequestOutput) -> RequestOutput | None:
        """One sequence's output as its group's: finished once every sequence is. DELTA outputs go out per
        sequence; the other kinds carry every sequence's latest completion (FINAL_ONLY once, at the end)."""
        group = self.groups[request.group_id]
        completion = output.outputs[0]
        group.latest[completion.index] = completion
        group.num_unfinished -= output.finished
        done = group.num_unfinished == 0
        if done:
            del self.groups[request.group_id]
        kind = request.sampling_params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not done:
            return None
        completions = [completion] if kind == RequestOutputKind.DELTA else \
            [group.latest[i] for i in sorted(group.latest)]
        return dataclasses.replace(output, outputs=completions, finished=done)

    @staticmethod
    def _take_prompt_logprobs(state: _RequestState, kind: RequestOutputKind) -> list | None:
        if state.prompt_logprobs is None or (kind == RequestOutputKind.DELTA and state.prompt_logprobs_sent):
            return None
        state.prompt_logprobs_sent = True
        return list(state.prompt_logprobs)
