"""A request inside the engine: its tokens, its progress and its block table."""
from __future__ import annotations

import enum
import time
from typing import NamedTuple

import torch

from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.processing.multimodal import MultiModalPlaceholder
from epdserve.shared.engine.structured_output import GrammarState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3  # blocks set aside, a connector filling them (or fetching its encoder outputs)
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # failed alone (e.g. its sampling raised); the engine went on with the others

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def dense_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> torch.Tensor | None:
    """A request's logit_bias as one [vocab_size] float32 row, made once per request (its n sequences share
    it): the sampler adds it to a row in one vector add, never iterating over its entries."""
    if not bias:
        return None
    row = torch.zeros(vocab_size, dtype=torch.float32)
    row[torch.tensor(list(bias.keys()), dtype=torch.long)] = torch.tensor(list(bias.values()), dtype=torch.float32)
    return row


class RequestFailure(NamedTuple):
    """Why one request failed on its own; the engine goes on with the others."""

    message: str
    # The request's own doing (HTTP 400): its structured output admits no token here, a token a peer
    # sampled does not fit it. Otherwise an internal error (its step or its sampling raised).
    bad_input: bool = False
    # Inputs a connector was to supply (image embeddings) could not be had where they were said to be (their
    # source gone): once they are made again elsewhere, the same request may succeed.
    inputs_unavailable: bool = False


class Request:
    """Owned by the scheduler; `block_ids` and `block_hashes` are changed only by the block manager.

    There are no prefill/decode phases: `num_computed_tokens` (tokens whose KV is in the cache) catches up
    with `num_tokens`. A chunked prefill, a prefix-cache hit and KV pulled from another engine are all the
    same thing: an increase of `num_computed_tokens`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        mm_placeholders: tuple[MultiModalPlaceholder, ...] = (),
        prompt: str | None = None,
        mm_embeddings: dict[str, torch.Tensor] | None = None,
        grammar: GrammarState | None = None,
        logit_bias: torch.Tensor | None = None,
        kv_transfer_params: object | None = None,
        mrope_positions: torch.Tensor | None = None,
        lora_name: str | None = None,
        lora_key: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.mm_placeholders = mm_placeholders
        # Its LoRA adapter (None: the base model): the name it was asked by, the key its KV is cached under
        # (the adapter's digest), and the model's slot holding it (set when the engine adds the request).
        self.lora_name = lora_name
        self.lora_key = lora_key
        self.lora_slot = -1
        # mm_hash -> encoder output [length, hidden_size] for each placeholder; needed while the
        # placeholder's positions are (re)computed, so kept until the request ends (preemption recomputes).
        # Missing ones are loaded by a KV connector before any step computes their positions.
        self.mm_embeddings = mm_embeddings or {}
        # M-RoPE models: the prompt's 3-D positions [3, num_prompt_tokens] (temporal, height, width), made
        # where the prompt was built; every later token continues from the largest plus one, as HF's
        # `rope_deltas` do. None: 1-D positions (a text prompt's three positions are all its index).
        self.mrope_positions = mrope_positions
        self.mrope_delta = 0 if mrope_positions is None else int(mrope_positions.max()) + 1 - len(prompt_token_ids)
        # For the KV connectors (kv_connector.py), opaque to the engine: where this request's KV may be had
        # from (a peer's handle, say). They are asked for it once: `kv_load_started` says they were.
        self.kv_transfer_params = kv_transfer_params
        self.kv_load_started = False
        # Leading output tokens a peer engine sampled (handoff.py): already delivered to the client.
        self.num_peer_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.failure: RequestFailure | None = None  # why it ended FINISHED_ERROR

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Draft tokens to verify in the next step (speculative decoding): proposed before each step, cut to
        # what the step has room for by the scheduler; they follow `all_token_ids` and are not the request's.
        self.spec_token_ids: list[int] = []
        # Its drafts' recent record, accepted and rejected (decayed; draft_policy.py).
        self.draft_hits = 0.0
        self.draft_misses = 0.0
        # Steps it is not asked for drafts (its last ones were all cut), and the rest after the next cut.
        self.draft_rest = 0
        self.draft_rest_next = 1
        # Prompt tokens it did not compute when first started: found in the prefix cache, or brought by a KV
        # tier's load (-1: not started yet).
        self.num_cached_tokens = -1
        # Whether its prompt's sources were counted (prompt_stats.py: once per request, whatever recomputes it).
        self.prompt_counted = False
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        # Finished, its blocks kept by a KV connector until it releases them (a prefill's, for the decode that
        # pulls them). Set by the scheduler.
        self.kv_held = False
        self.block_hashes: list[bytes] = []
        # Parallel sampling (n > 1, see parallel_sampling.py): the id its caller knows the request by (the
        # parent's, shared by its n sequences; else its own), and this sequence's index among the n.
        self.group_id = request_id
        self.index = 0
        # On the sequence that computes the prompt, until it has: the group's other sequences, which then
        # fork from it. On each of those, meanwhile: that sequence.
        self.forks: list[Request] = []
        self.fork_of: Request | None = None

        limit = max_model_len - len(prompt_token_ids)
        self.max_output_tokens = limit if sampling_params.max_tokens is None else min(
            sampling_params.max_tokens, limit)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else frozenset(sampling_params.eos_token_ids))
        # A seeded request's tokens are drawn from its seed and their positions (sampler.seeded_generator),
        # so the same seed gives the same tokens whatever else shares the batch and whichever engine samples.
        self.seed: int | None = sampling_params.seed
        self.first_scheduled_time: float | None = None
        # The structured-output matcher, fed every output token (see `structured_output`).
        self.grammar = grammar
        self.logit_bias = logit_bias  # [vocab_size] float32 (dense_logit_bias), or None
        assert (logit_bias is None) == (not sampling_params.logit_bias), "logit_bias needs its dense row"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Whether all but its last token are computed: a step computes that one (and any drafts) alone."""
        return self.num_computed_tokens == self.num_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """The 3-D (M-RoPE) positions of tokens start..end-1, [3, end - start] int64."""
        if self.mrope_positions is None:  # a text prompt: every token's three positions are its index
            return torch.arange(start, end).expand(3, -1)
        num_prompt = len(self.prompt_token_ids)
        first_later = max(start, num_prompt)
        later = torch.arange(first_later, max(first_later, end)) + self.mrope_delta
        return torch.cat((self.mrope_positions[:, start:min(end, num_prompt)], later.expand(3, -1)), dim=1)

    def missing_embeddings(self, num_computed: int) -> tuple[str, ...]:
        """Encoder outputs this request lacks for the positions from `num_computed` on, which it must compute."""
        return tuple(dict.fromkeys(ph.mm_hash for ph in self.mm_placeholders
                                   if ph.offset + ph.length > num_computed and ph.mm_hash not in self.mm_embeddings))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop(self) -> bool:
        """Sets a finished status if the last token ends the request (token stops; strings are the engine's)."""
        last = self.output_token_ids[-1]
        if self.grammar is not None and self._check_grammar_stop():
            return True
        if self.num_output_tokens >= self.sampling_params.min_tokens and last in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None if last in self.sampling_params.eos_token_ids and \
                last not in self.sampling_params.stop_token_ids else last
            return True
        if self.num_output_tokens >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _check_grammar_stop(self) -> bool:
        if self.grammar.rejected_token is not None:
            # Only a token sampled without the bitmask (a peer's first token) can get here.
            self.status = RequestStatus.FINISHED_ERROR
            self.failure = RequestFailure(
                f"token {self.grammar.rejected_token} does not fit the request's structured output", bad_input=True)
            return True
        if self.grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            last = self.output_token_ids[-1]
            self.stop_reason = last if last in self.sampling_params.stop_token_ids else None
            return True
        return False
