"""Turns one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The order is vLLM's: min_tokens masking and penalties first (they change what greedy picks too), then
greedy rows take the argmax; random rows are scaled by temperature, filtered by min-p, top-k and top-p,
and sampled by the exponential race (argmax of probs / Exp(1) noise), which lets each seeded request
draw its noise from its own generator. Logprobs are of the raw model distribution, as vLLM reports them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from epdserve.shared.request import Request


class TokenLogprobs(NamedTuple):
    logprob: float  # of the sampled token
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Noise for unseeded requests; seeded ones use their own generator.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        # logits: [num_requests, vocab_size] float32, row i belongs to requests[i]
        want_logprobs = [r.sampling_params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_penalties(logits, requests)
        greedy = [r.sampling_params.is_greedy for r in requests]
        token_ids = torch.empty(len(requests), dtype=torch.long)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if greedy_rows:
            token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows], [requests[i] for i in random_rows])

        ids = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, w in enumerate(want_logprobs) if w]
            max_n = max(requests[i].sampling_params.logprobs for i in rows)
            top_lp, top_ids = raw_logprobs[rows].topk(max(max_n, 1), dim=-1)
            chosen = raw_logprobs[rows, token_ids[rows]]
            ranks = (raw_logprobs[rows] > chosen[:, None]).sum(-1) + 1
            for j, i in enumerate(rows):
                n = requests[i].sampling_params.logprobs
                top = list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist()))
                logprobs[i] = TokenLogprobs(float(chosen[j]), int(ranks[j]), top)
        return SamplerOutput(ids, logprobs)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [(i, r) for i, r in enumerate(requests)
                if r.num_output_tokens < r.sampling_params.min_tokens and r.stop_token_ids]
        if rows:
            logits = logits.clone()
            for i, r in rows:
                logits[i, list(r.stop_token_ids)] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [(i, r) for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, r in rows:
            sp, row = r.sampling_params, logits[i]
            if sp.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool)
                seen[torch.tensor(r.all_token_ids, dtype=torch.long)] = True
                penalised = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            if (sp.frequency_penalty or sp.presence_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)
                row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temperature = torch.tensor([r.sampling_params.temperature for r in requests]).unsqueeze(1)
        logits = logits / temperature
        min_p = torch.tensor([r.sampling_params.min_p for r in requests])
        if bool((min_p > 0).any()):
            probs = torch.softmax(logits, dim=-1)
            too_small = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(too_small, float("-inf"))
        top_k = torch.tensor([r.sampling_params.top_k for r in requests])
        top_p = torch.tensor([r.sampling_params.top_p for r in requests])
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for j, r in enumerate(requests):
            noise[j].exponential_(generator=r.generator or self.generator)
        return probs.div_(noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [n, vocab]; top_k 0 = off; top_p 1.0 = off
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop |= torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
