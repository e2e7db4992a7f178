"""Turns one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The order is vLLM's: logit_bias, min_tokens masking and penalties first (they change what greedy picks
too), then the grammar bitmask of structured outputs (last, so that nothing can lift a forbidden token
back), then greedy rows take the argmax; random rows are scaled by temperature and filtered by min-p,
top-k and top-p. Logprobs are of the raw model distribution, as vLLM reports them. A batch that uses
none of these processors samples from the model's logits as they are, with no copy.

Random rows are sampled by inverse CDF with one uniform per draw, not by an exponential race: a race
needs one random number per vocabulary entry, and generating those costs far more than the rest of the
sampler. Top-p needs no sort: a draw from the (min-p, top-k) filtered distribution is accepted when the
tokens strictly more likely than it hold less than top_p of the mass, and otherwise redrawn from those
more likely tokens only. Each round removes the rejected token and everything below it, so the nucleus
keeps its relative probabilities; this is exact, and one or two rounds usually suffice.

Seeded requests draw from generators of their own, so their tokens do not depend on the rest of the batch:
one for each output position, seeded from the request's seed and the position (`seeded_generator`), giving
the uniforms of that token's rounds in order. A token's noise thus depends on nothing sampled before it: an
engine that takes over a request whose first tokens another engine sampled, or samples a position again,
draws what one engine doing it all would - and nothing is drawn for positions sampled elsewhere.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import NamedTuple

import time

import numpy as np
import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_layer_ops
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.structured_output import apply_bitmask

# Inverse-CDF sampling first picks a block of up to this many tokens, then a token inside it; the
# cumulative sums over blocks and within one block are short, so they are done in float64.
_BLOCK = 256


class SampledLogprobs(NamedTuple):
    """The engine's logprobs of one sampled token (what travels is `protocol.TokenLogprobs`, made from
    the engine's outputs by `epdserve.services.host.wire`)."""

    logprob: float  # of the sampled token
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[SampledLogprobs | None]
    # Rows whose structured output allows no token at all here (row -> why): their tokens mean nothing.
    failed: dict[int, str] = {}


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """The generator of the uniforms a seeded request's output token at `position` (0: its first) is sampled
    with. Seed and position are hashed together, so neighbouring seeds and positions give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring for the order of things.

    Keeps a few [rows, vocab] float32 scratch tensors from call to call, sized by the largest batch seen:
    a fresh tensor that size is a fresh memory mapping whose pages fault in on first touch, which costs
    more than the arithmetic done in it. Not for concurrent use."""

    def __init__(self, seed: int = 0) -> None:
        # Noise for unseeded requests; seeded ones use their own generator.
        self.generator = torch.Generator().manual_seed(seed)
        self._scratch: dict[str, torch.Tensor] = {}
        # Time spent filling and applying grammar bitmasks (structured outputs), summed over calls.
        self.grammar_seconds = 0.0

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row. logits: [num_requests, vocab_size] float32, row i is requests[i]'s;
        left unchanged."""
        raw = logits = logits.float()
        logits, failed = self._apply_logits_processors(logits, requests)
        greedy = [r.sampling_params.is_greedy for r in requests]
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)
        elif not greedy_rows:
            token_ids = self._sample(logits, requests)
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long)
            token_ids[greedy_rows] = _take(logits, greedy_rows).argmax(dim=-1)
            token_ids[random_rows] = self._sample(_take(logits, random_rows), [requests[i] for i in random_rows])

        ids = token_ids.tolist()
        logprobs: list[SampledLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if rows:
            # Of the raw distribution; the working logits are no longer needed, so their buffer takes them.
            raw_logprobs = _take(torch.log_softmax(raw, dim=-1, out=self._buffer("logits", raw.shape)), rows)
            max_n = max(requests[i].sampling_params.logprobs for i in rows)
            top_lp, top_ids = raw_logprobs.topk(max(max_n, 1), dim=-1)
            chosen = raw_logprobs.gather(1, token_ids[rows].unsqueeze(1))
            ranks = (raw_logprobs > chosen).sum(-1) + 1
            for j, i in enumerate(rows):
                n = requests[i].sampling_params.logprobs
                top = list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist()))
                logprobs[i] = SampledLogprobs(float(chosen[j]), int(ranks[j]), top)
        return SamplerOutput(ids, logprobs, failed)

    def _buffer(self, name: str, shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Scratch tensor `name` of this shape, contents undefined; valid until the next request for `name`."""
        size = shape[0] * shape[1]
        flat = self._scratch.get(name)
        if flat is None or flat.numel() < size:
            flat = self._scratch[name] = torch.empty(size, dtype=dtype)
        return flat[:size].view(shape)

    def _apply_logits_processors(self, logits: torch.Tensor,
                                 requests: list[Request]) -> tuple[torch.Tensor, dict[int, str]]:
        """(logits itself when nothing applies, else a scratch copy with logit_bias added, stop tokens masked
        for requests short of min_tokens, the repetition, frequency and presence penalties applied, and
        last the tokens each constrained request's grammar forbids masked; the rows whose grammar allows
        no token at all, and why)."""
        vocab = logits.shape[-1]
        bias_rows = [i for i, r in enumerate(requests) if r.logit_bias is not None]
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        # Ids outside the vocabulary cannot be sampled anyway; skipping them keeps a bad id from failing the batch.
        stops = [(i, t) for i, r in enumerate(requests)
                 if r.num_output_tokens < r.sampling_params.min_tokens for t in r.stop_token_ids if 0 <= t < vocab]
        # Only tokens a request has seen are penalised, so the work is per (row, token) pair.
        rep_rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        count_rows = [i for i, r in enumerate(requests)
                      if r.sampling_params.frequency_penalty or r.sampling_params.presence_penalty]
        if not stops and not rep_rows and not count_rows and not bias_rows and not grammar_rows:
            return logits, {}
        raw = logits
        logits = self._buffer("logits", logits.shape).copy_(logits)
        if bias_rows:
            # Rows sharing one bias (a request's n sequences) get it in one add, whatever its size.
            by_bias: dict[int, tuple[torch.Tensor, list[int]]] = {}
            for i in bias_rows:
                bias = requests[i].logit_bias
                by_bias.setdefault(id(bias), (bias, []))[1].append(i)
            for bias, rows in by_bias.values():
                logits.index_add_(0, torch.tensor(rows), bias.expand(len(rows), -1))
        if stops:
            rows, cols = torch.tensor(stops, dtype=torch.long).unbind(1)
            logits[rows, cols] = float("-inf")
        if rep_rows:
            rows, cols, _ = _token_counts(rep_rows, [requests[i].all_token_ids for i in rep_rows], vocab)
            penalty = torch.tensor([r.sampling_params.repetition_penalty for r in requests])[rows]
            seen = logits[rows, cols]
            logits[rows, cols] = _finite(torch.where(seen > 0, seen / penalty, seen * penalty), seen)
        if count_rows:
            rows, cols, counts = _token_counts(count_rows, [requests[i].output_token_ids for i in count_rows], vocab)
            freq = torch.tensor([r.sampling_params.frequency_penalty for r in requests])[rows]
            pres = torch.tensor([r.sampling_params.presence_penalty for r in requests])[rows]
            seen = logits[rows, cols]
            logits[rows, cols] = _finite(seen - (freq * counts + pres), seen)
        if grammar_rows:
            start = time.perf_counter()
            bitmask = self._buffer("bitmask", (len(requests), (vocab + 31) // 32), torch.int32)
            apply_bitmask(logits, [requests[i].grammar for i in grammar_rows], grammar_rows, bitmask)
            if stops:
                self._let_grammars_end(logits, raw, requests, grammar_rows, bitmask)
            failed = _dead_ends(logits, grammar_rows)
            self.grammar_seconds += time.perf_counter() - start
            return logits, failed
        return logits, {}

    @staticmethod
    def _let_grammars_end(logits: torch.Tensor, raw: torch.Tensor, requests: list[Request], grammar_rows: list[int],
                          bitmask: torch.Tensor) -> None:
        """A grammar that allows nothing but its end while min_tokens masks the stop tokens would leave
        its row without a single token: the grammar wins there, and its stop tokens get their raw logits
        back (under the bitmask), so the request ends as its output format demands."""
        rows = torch.tensor(grammar_rows)
        empty = rows[torch.isneginf(logits[rows]).all(dim=1)].tolist()
        for i in empty:
            stop_ids = torch.tensor(sorted(requests[i].stop_token_ids), dtype=torch.long)
            logits[i, stop_ids] = raw[i, stop_ids]
            apply_bitmask(logits, [requests[i].grammar], [i], bitmask)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token a row, each row's first uniform drawn in row order. Rows sampled by temperature alone go
        through one C++ op where it is built (cpu_layer_ops.sample_by_temperature: the same inverse CDF, over
        exp(logit / temperature - max), without a softmax and a dozen small ops), the others through the filters;
        which way a row goes depends on its own parameters only, so a seeded request's tokens never depend on
        its batch."""
        vocab = logits.shape[-1]
        params = [r.sampling_params for r in requests]
        noise = _Uniforms(requests, self.generator)
        u = noise.next(range(len(requests)))
        plain = [i for i, sp in enumerate(params) if sp.min_p == 0 and not 0 < sp.top_k < vocab and sp.top_p >= 1.0] \
            if cpu_layer_ops.available() else []
        if plain:
            temperature = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
            drawn = cpu_layer_ops.sample_by_temperature(_take(logits, plain), temperature, _take(u, plain))
            if len(plain) == len(requests):
                return drawn
        plain_rows = set(plain)
        rest = [i for i in range(len(requests)) if i not in plain_rows]
        token_ids = torch.empty(len(requests), dtype=torch.long)
        if plain:
            token_ids[plain] = drawn
        token_ids[rest] = self._filtered(_take(logits, rest), [params[i] for i in rest], rest, _take(u, rest), noise)
        return token_ids

    def _filtered(self, logits: torch.Tensor, params: list, rows: list[int], u: torch.Tensor,
                  noise: _Uniforms) -> torch.Tensor:
        """Tokens for `rows` (the batch's rows `logits` holds, in order; `u` their first uniforms) from softmax(logits
        / temperature) filtered by min-p, top-k and top-p."""
        vocab = logits.shape[-1]
        probs = self._buffer("probs", logits.shape)
        temperature = [sp.temperature for sp in params]
        if any(t != 1.0 for t in temperature):
            # Into the probabilities' buffer, which softmax then overwrites in place.
            logits = torch.div(logits, torch.tensor(temperature).unsqueeze(1), out=probs)
        probs = torch.softmax(logits, dim=-1, out=probs)

        if any(sp.min_p > 0 for sp in params):
            min_p = torch.tensor([sp.min_p for sp in params]).unsqueeze(1)
            self._zero_below_(probs, min_p * probs.amax(dim=-1, keepdim=True))
        # top_k at or above the vocabulary size keeps everything, like 0; Python ints, so any size is fine.
        k_rows = [i for i, sp in enumerate(params) if 0 < sp.top_k < vocab]
        if k_rows:
            top_k = torch.tensor([params[i].top_k for i in k_rows])
            k_probs = _take(probs, k_rows)
            # Everything at least as likely as the k-th most likely token stays (ties included, as in HF).
            probs = _put(probs, k_rows, self._zero_below_(k_probs, _kth_largest(k_probs, top_k)))

        token_ids = _inverse_cdf(probs, u)
        p_rows = [i for i, sp in enumerate(params) if sp.top_p < 1.0]
        if p_rows:
            top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=torch.float64)
            drawn = self._top_p_by_rejection(_take(probs, p_rows), _take(token_ids, p_rows), top_p,
                                             lambda again: noise.next([rows[p_rows[j]] for j in again]))
            token_ids = _put(token_ids, p_rows, drawn)
        return token_ids

    def _zero_below_(self, weights: torch.Tensor, threshold: torch.Tensor, strict: bool = False) -> torch.Tensor:
        """Zero the entries of weights below threshold (at or below it, if strict), in place. Multiplying by
        a 0/1 float mask is branch-free; a masked fill over an unpredictable mask is ~10x slower."""
        compare = torch.gt if strict else torch.ge
        return weights.mul_(compare(weights, threshold, out=self._buffer("mask", weights.shape)))

    def _top_p_by_rejection(self, weights: torch.Tensor, token_ids: torch.Tensor, top_p: torch.Tensor,
                            redraw) -> torch.Tensor:
        """Turn draws from `weights` (overwritten) into draws from each row's top-p nucleus.

        The nucleus is every token whose strictly more likely tokens hold less than top_p of the total: the
        smallest set of most likely tokens reaching top_p, all ties at its edge included. A draw outside it
        is redrawn from the tokens strictly more likely than the draw, a set that still contains the
        nucleus; so an accepted draw has the nucleus' distribution. redraw(row indices) gives uniforms."""
        token_ids = token_ids.clone()
        limit = top_p * _row_sums(weights)
        active = torch.arange(len(token_ids))
        while len(active):
            above = self._zero_below_(weights, weights.gather(1, token_ids[active].unsqueeze(1)), strict=True)
            mass_above = _row_sums(above)
            # A most likely token (nothing strictly above it) is always in the nucleus, whatever top_p: this
            # also ends the loop when top_p * total underflows to 0.
            rejected = (mass_above >= limit[active]) & (mass_above > 0)
            if not bool(rejected.any()):
                break
            active, weights = active[rejected], above[rejected]
            token_ids[active] = _inverse_cdf(weights, redraw(active.tolist()))
        return token_ids


def _dead_ends(logits: torch.Tensor, grammar_rows: list[int]) -> dict[int, str]:
    """Rows of `grammar_rows` whose grammar allows no token of this vocabulary (every logit -inf), and why;
    such a row is given uniform logits, so that sampling it stays well defined (its token is dropped)."""
    rows = torch.tensor(grammar_rows)
    dead = rows[torch.isneginf(logits[rows]).all(dim=1)].tolist()
    for i in dead:
        logits[i] = 0.0
    return {i: "no token of this model's vocabulary can continue the request's structured output here"
            for i in dead}


def _finite(penalised: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Penalised logits kept finite where they were: a huge penalty (repetition_penalty 1e300 is valid)
    overflows to -inf, and a row whose grammar allows only penalised tokens would then allow none."""
    info = torch.finfo(penalised.dtype)
    return torch.where(torch.isfinite(before), penalised.clamp(info.min, info.max), penalised)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: a copy, or t itself when rows are all of t's (so writing into it may write into t)."""
    return t if len(rows) == len(t) else t.index_select(0, torch.tensor(rows))


def _put(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """t with t[rows] = values, written in place (t is the sampler's own) unless values is all of it."""
    if len(rows) == len(t):
        return values
    t[rows] = values
    return t


class _Uniforms:
    """Per-row uniforms on [0, 1): a seeded row's from the generator of its position (`seeded_generator`), in
    order, the others from the sampler's generator, one call per batch of rows."""

    def __init__(self, requests: list[Request], generator: torch.Generator) -> None:
        self.generator = generator
        self.seeded = {i: seeded_generator(r.seed, r.num_output_tokens) for i, r in enumerate(requests)
                       if r.seed is not None}

    def next(self, rows) -> torch.Tensor:
        rows = list(rows)
        u = torch.rand(len(rows), dtype=torch.float64, generator=self.generator)
        for j, i in enumerate(rows):
            if i in self.seeded:
                u[j] = torch.rand((), dtype=torch.float64, generator=self.seeded[i])
        return u


def _token_counts(rows: list[int], token_lists: list[list[int]], vocab: int):
    """The distinct (row, token id) pairs of rows[i] with token_lists[i], and how often each occurs:
    (rows, ids, counts) tensors. Ids outside the vocabulary are left out."""
    lengths = [len(t) for t in token_lists]
    # numpy reads a Python iterable of ints several times faster than torch.tensor does.
    ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, sum(lengths)))
    row_of = torch.tensor(rows).repeat_interleave(torch.tensor(lengths))
    inside = (ids >= 0) & (ids < vocab)
    keys, counts = torch.unique(row_of[inside] * vocab + ids[inside], return_counts=True)
    return keys // vocab, keys % vocab, counts.float()


def _blocks(weights: torch.Tensor) -> torch.Tensor:
    """weights [n, vocab] as [n, blocks, block size]: a view when a power of two from 32 to _BLOCK divides
    the vocabulary (the largest such), else a copy zero-padded to a multiple of _BLOCK."""
    vocab = weights.shape[-1]
    size = min(vocab & -vocab, _BLOCK)
    if size < 32:
        size = _BLOCK
        weights = F.pad(weights, (0, -vocab % size))
    return weights.view(weights.shape[0], -1, size)


def _row_sums(weights: torch.Tensor) -> torch.Tensor:
    # Float32 within a block, float64 across blocks: the same sums `_inverse_cdf` samples against.
    return _blocks(weights).sum(-1).sum(-1, dtype=torch.float64)


def _kth_largest(weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[n, 1]: the k[i]-th largest value of each row of weights [n, vocab] (non-negative), 1 <= k < vocab.

    The k largest values of a row lie in the k blocks with the largest maxima (each of the other blocks
    has k block maxima at least as large as all its values), so for small k only those are searched."""
    k_max = int(k.max())
    blocks = _blocks(weights)
    n, num_blocks, size = blocks.shape
    if k_max * size * 2 <= weights.shape[-1]:
        best = blocks.amax(-1).topk(k_max, dim=-1).indices + torch.arange(n).unsqueeze(1) * num_blocks
        weights = blocks.reshape(n * num_blocks, size).index_select(0, best.flatten()).view(n, -1)
    return weights.topk(k_max, dim=-1).values.gather(1, k.unsqueeze(1) - 1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the token i with cdf[i-1] <= u * total < cdf[i]: i with probability weights[i] / total.

    weights: [n, vocab] float32, non-negative; u: [n] float64 uniforms on [0, 1). A token of zero weight
    is never returned. Two levels, a block then a token within it, keep the cumulative sums short. Past the
    block sums (one pass over the vocabulary) a row is a few hundred numbers, worked on in numpy: at batch 1
    its dozen calls took 96 us where torch's took 130-170 (the same sums in the same order, so the same token)."""
    n, vocab = weights.shape
    blocks = _blocks(weights)
    size = blocks.shape[2]
    rows = np.arange(n)
    block_cdf = np.cumsum(blocks.sum(-1).numpy(), axis=1, dtype=np.float64)  # [n, num_blocks]
    # u < 1 keeps u * total below the total: rounding to nearest cannot reach it.
    target = u.numpy() * block_cdf[:, -1]
    # The first cumulative sum above the target (the sums never decrease): how many are at or below it.
    block = np.minimum((block_cdf <= target[:, None]).sum(1), block_cdf.shape[1] - 1)
    before = np.where(block > 0, block_cdf[rows, block - 1], 0.0)
    within_cdf = np.cumsum(blocks.numpy()[rows, block], axis=1, dtype=np.float64)  # [n, size]
    # The block's float64 sum may differ from its float32 one in the last bits: stay inside it.
    rest = np.minimum(target - before, np.nextafter(within_cdf[:, -1], 0.0))
    offset = np.minimum((within_cdf <= rest[:, None]).sum(1), size - 1)
    # Only rows of NaNs (a broken model) can land in the padding: clamp rather than fail the batch.
    return torch.from_numpy(np.minimum(block * size + offset, vocab - 1))
