"""Turns one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The order is vLLM's: min_tokens masking and penalties first (they change what greedy picks too), then
greedy rows take the argmax; random rows are scaled by temperature and filtered by min-p, top-k and top-p.
Logprobs are of the raw model distribution, as vLLM reports them.

Random rows are sampled by inverse CDF with one uniform per draw, not by an exponential race: a race
needs one random number per vocabulary entry, and generating those costs far more than the rest of the
sampler. Top-p needs no sort: a draw from the (min-p, top-k) filtered distribution is accepted when the
tokens strictly more likely than it hold less than top_p of the mass, and otherwise redrawn from those
more likely tokens only. Each round removes the rejected token and everything below it, so the nucleus
keeps its relative probabilities; this is exact, and one or two rounds usually suffice.

Seeded requests draw from their own generator, so their tokens do not depend on the rest of the batch.
Each sampled token of a seeded request consumes one vocabulary-sized row of float64 uniforms from it
(`draw_seeded_noise`), however many rounds top-p takes; an engine that takes over a request whose token
another engine sampled advances the generator the same way.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from epdserve.shared.request import Request

# Inverse-CDF sampling first picks a block of this many tokens, then a token inside it; the cumulative
# sums over blocks and within one block are short, so they are done in float64.
_BLOCK = 256


class TokenLogprobs(NamedTuple):
    logprob: float  # of the sampled token
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def draw_seeded_noise(generator: torch.Generator, vocab_size: int) -> torch.Tensor:
    """The noise one sampled token of a seeded request consumes: `vocab_size` float64 uniforms.

    This advances the generator exactly as `torch.empty(vocab_size).exponential_(generator=...)` does,
    so either may stand for a token sampled elsewhere."""
    return torch.rand(vocab_size, dtype=torch.float64, generator=generator)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Noise for unseeded requests; seeded ones use their own generator.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row. logits: [num_requests, vocab_size] float32, row i is requests[i]'s."""
        want_logprobs = [r.sampling_params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_penalties(logits, requests)
        greedy = [r.sampling_params.is_greedy for r in requests]
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if not greedy_rows:
            token_ids = self._sample(logits, requests)
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long)
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
        vocab = logits.shape[-1]
        # Ids outside the vocabulary cannot be sampled anyway; skipping them keeps a bad id from failing the batch.
        pairs = [(i, t) for i, r in enumerate(requests)
                 if r.num_output_tokens < r.sampling_params.min_tokens for t in r.stop_token_ids if 0 <= t < vocab]
        if not pairs:
            return logits
        rows, cols = torch.tensor(pairs, dtype=torch.long).unbind(1)
        return logits.index_put((rows, cols), torch.tensor(float("-inf")))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not rows:
            return logits
        params = [requests[i].sampling_params for i in rows]
        penalised = logits[rows]  # a copy; rows without penalties stay as they are
        if any(sp.repetition_penalty != 1.0 for sp in params):
            # Rows with penalty 1.0 are unchanged by it: x / 1 and x * 1 are x.
            rep = torch.tensor([sp.repetition_penalty for sp in params]).unsqueeze(1)
            seen = _token_counts([requests[i].all_token_ids for i in rows], penalised.shape[-1]) > 0
            scaled = torch.where(penalised > 0, penalised / rep, penalised * rep)
            penalised = torch.where(seen, scaled, penalised)
        if any(sp.frequency_penalty or sp.presence_penalty for sp in params):
            counts = _token_counts([requests[i].output_token_ids for i in rows], penalised.shape[-1])
            freq = torch.tensor([sp.frequency_penalty for sp in params]).unsqueeze(1)
            pres = torch.tensor([sp.presence_penalty for sp in params]).unsqueeze(1)
            penalised = penalised - (freq * counts + pres * (counts > 0))
        if len(rows) == len(requests):
            return penalised
        logits = logits.clone()
        logits[rows] = penalised
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        params = [r.sampling_params for r in requests]
        temperature = [sp.temperature for sp in params]
        if any(t != 1.0 for t in temperature):
            logits = logits / torch.tensor(temperature).unsqueeze(1)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)

        if any(sp.min_p > 0 for sp in params):
            min_p = torch.tensor([sp.min_p for sp in params]).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        # top_k at or above the vocabulary size keeps everything, like 0; Python ints, so any size is fine.
        k_rows = [i for i, sp in enumerate(params) if 0 < sp.top_k < vocab]
        if k_rows:
            top_k = torch.tensor([params[i].top_k for i in k_rows])
            rows = _take(probs, k_rows)
            # Everything at least as likely as the k-th most likely token stays (ties included, as in HF).
            kth = rows.topk(int(top_k.max()), dim=-1).values.gather(1, top_k.unsqueeze(1) - 1)
            probs = _put(probs, k_rows, rows.masked_fill(rows < kth, 0.0))

        noise = _Uniforms(requests, vocab, self.generator)
        token_ids = _inverse_cdf(probs, noise.next(range(len(requests))))
        p_rows = [i for i, sp in enumerate(params) if sp.top_p < 1.0]
        if p_rows:
            top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=torch.float64)
            drawn = _top_p_by_rejection(_take(probs, p_rows), _take(token_ids, p_rows), top_p,
                                        lambda rows: noise.next([p_rows[j] for j in rows]))
            token_ids = _put(token_ids, p_rows, drawn)
        return token_ids


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without the copy when rows are all of t's (the callers never write into the result)."""
    return t if len(rows) == len(t) else t[rows]


def _put(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """t with t[rows] = values, written in place (t is the sampler's own) unless values is all of it."""
    if len(rows) == len(t):
        return values
    t[rows] = values
    return t


class _Uniforms:
    """Per-row uniforms on [0, 1): a seeded row's come from its `draw_seeded_noise` row in order, the
    others from the sampler's generator, one call per batch of rows."""

    def __init__(self, requests: list[Request], vocab: int, generator: torch.Generator) -> None:
        self.generator = generator
        self.seeded = {i: draw_seeded_noise(r.generator, vocab) for i, r in enumerate(requests)
                       if r.generator is not None}
        self.used = dict.fromkeys(self.seeded, 0)

    def next(self, rows) -> torch.Tensor:
        rows = list(rows)
        u = torch.rand(len(rows), dtype=torch.float64, generator=self.generator)
        for j, i in enumerate(rows):
            if i in self.seeded:
                # Rounds cannot outnumber the vocabulary (each removes a token); the modulo only guards.
                u[j] = self.seeded[i][self.used[i] % len(self.seeded[i])]
                self.used[i] += 1
        return u


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token id occurs in each list (ids outside the
    vocabulary are ignored)."""
    counts = torch.zeros(len(token_lists), vocab)
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    inside = (ids >= 0) & (ids < vocab)
    counts.index_put_((rows[inside], ids[inside]), torch.ones(()), accumulate=True)
    return counts


def _blocks(weights: torch.Tensor) -> torch.Tensor:
    """weights [n, vocab] as [n, blocks, _BLOCK], zero-padded."""
    pad = -weights.shape[-1] % _BLOCK
    if pad:
        weights = F.pad(weights, (0, pad))
    return weights.view(weights.shape[0], -1, _BLOCK)


def _row_sums(weights: torch.Tensor) -> torch.Tensor:
    # Float32 within a block, float64 across blocks: the same sums `_inverse_cdf` samples against.
    return _blocks(weights).sum(-1).sum(-1, dtype=torch.float64)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the token i with cdf[i-1] <= u * total < cdf[i]: i with probability weights[i] / total.

    weights: [n, vocab] float32, non-negative; u: [n] float64 uniforms on [0, 1). A token of zero weight
    is never returned. Two levels, a block then a token within it, keep the cumulative sums short."""
    n, vocab = weights.shape
    blocks = _blocks(weights)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # [n, num_blocks]
    total = block_cdf[:, -1:]
    # Strictly below the total, so that rounding in u * total cannot step past the last nonzero block.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    within_cdf = blocks.gather(1, block.unsqueeze(-1).expand(n, 1, _BLOCK)).squeeze(1).double().cumsum(-1)
    within_total = within_cdf[:, -1:]
    # The block's float64 sum may differ from its float32 one in the last bits: stay inside it.
    rest = torch.minimum(target - before, torch.nextafter(within_total, torch.zeros_like(within_total)))
    offset = torch.searchsorted(within_cdf, rest, right=True).clamp_(max=_BLOCK - 1)
    # Only rows of NaNs (a broken model) can land in the padding: clamp rather than fail the batch.
    return (block * _BLOCK + offset).squeeze(1).clamp_(max=vocab - 1)


def _top_p_by_rejection(weights: torch.Tensor, token_ids: torch.Tensor, top_p: torch.Tensor, redraw) -> torch.Tensor:
    """Turn draws from `weights` into draws from each row's top-p nucleus.

    The nucleus is every token whose strictly more likely tokens hold less than top_p of the total: the
    smallest set of most likely tokens reaching top_p, all ties at its edge included. A draw outside it is
    redrawn from the tokens strictly more likely than the draw, a set that still contains the nucleus;
    so an accepted draw has the nucleus' distribution. redraw(row indices) gives fresh uniforms."""
    token_ids = token_ids.clone()
    limit = top_p * _row_sums(weights)
    active = torch.arange(len(token_ids))
    while len(active):
        drawn = weights.gather(1, token_ids[active].unsqueeze(1))
        above = torch.where(weights > drawn, weights, 0.0)
        rejected = _row_sums(above) >= limit[active]
        if not bool(rejected.any()):
            break
        active, weights = active[rejected], above[rejected]
        token_ids[active] = _inverse_cdf(weights, redraw(active.tolist()))
    return token_ids
