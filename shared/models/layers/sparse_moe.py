"""The sparse MLP of a mixture-of-experts model (Qwen3-MoE, Mixtral): a top-k router and the experts.

Numerics follow HF transformers: the router's softmax in float32, the top-k probabilities renormalised
where the config says so, each expert a gated SiLU MLP, and a token's expert outputs added in ascending
expert order onto zeros, so that float32 output matches `generate` token for token.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops, torch_moe
from epdserve.shared.config import ModelConfig
from epdserve.shared.models.layers.linear import Linear


class ExpertBatch(NamedTuple):
    """A step's (token, choice) pairs grouped by expert: rows in ascending expert order, and within an
    expert in token order."""
    x: torch.Tensor  # [num_pairs, hidden_size]: each row's token's input
    tokens: torch.Tensor  # [num_pairs]: each row's token
    weights: torch.Tensor  # [num_pairs]: each row's router weight
    counts: list[int]  # rows per expert


class Experts(nn.Module):
    """Every expert's weights stacked, under HF's own names and layout (transformers 5):
    gate_up_proj [num_experts, 2 * intermediate_size, hidden_size] (gate rows, then up rows) and
    down_proj [num_experts, hidden_size, intermediate_size].

    A step groups its tokens by expert and runs each expert that received tokens once, on all of them. On
    CPU that is three parts - dispatch() sorts the (token, expert) pairs by expert and gathers their inputs,
    run() puts each expert's rows through the packed linear kernel, which is batch-invariant (a token's
    result does not depend on which tokens share its experts), and combine() adds each token's weighted
    outputs - with loops over experts and over top-k only, never over tokens; on CUDA the Triton kernel
    (fused_moe.py) runs every expert in one grouped matmul per projection."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # On CPU, per expert, Linear layers over its slices of the stacked weights (not registered: they have
        # no parameters of their own); made by pack().
        self._gate_up: list[Linear] = []
        self._down: list[Linear] = []

    def checkpoint_pieces(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """HF's per-expert tensors (`{prefix}{e}.gate_proj.weight`...) -> (our parameter, index into it)."""
        size = self.intermediate_size
        pieces = {}
        for e in range(self.num_experts):
            pieces[f"{prefix}{e}.gate_proj.weight"] = (prefix + "gate_up_proj", (e, slice(0, size)))
            pieces[f"{prefix}{e}.up_proj.weight"] = (prefix + "gate_up_proj", (e, slice(size, 2 * size)))
            pieces[f"{prefix}{e}.down_proj.weight"] = (prefix + "down_proj", (e,))
        return pieces

    def pack(self) -> None:
        """Pack each expert's weights for the CPU kernels; call again after the weights change."""
        if self.gate_up_proj.device.type == "cpu":
            self._gate_up = [Linear.over(w) for w in self.gate_up_proj.data]
            self._down = [Linear.over(w) for w in self.down_proj.data]

    @property
    def groups_on_cpu(self) -> bool:
        """Whether forward() runs as dispatch(), run() and combine() (packed on CPU)."""
        return bool(self._gate_up)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden_size]; topk_ids, topk_weights: [num_tokens, top_k]."""
        if x.device.type == "cuda":
            from epdserve.kernels.fused_moe import fused_moe

            return fused_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)
        if not self._gate_up:
            return torch_moe.fused_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)
        batch = self.dispatch(x, topk_ids, topk_weights)
        return self.combine(self.run(batch), batch, x)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> ExpertBatch:
        """Group the step's (token, choice) pairs by expert and gather their inputs, with no loop over tokens."""
        pairs, counts = torch_moe.tokens_by_expert(topk_ids, self.num_experts)
        tokens = pairs // topk_ids.shape[1]
        # index_select, not x[tokens]: the same rows copied, 4-6x faster than advanced indexing (measured:
        # 256 and 4096 rows of 512 float32).
        return ExpertBatch(x.index_select(0, tokens), tokens, topk_weights.flatten().index_select(0, pairs), counts)

    def run(self, batch: ExpertBatch) -> list[torch.Tensor]:
        """Each expert that received rows, once, on all of them: its outputs, unweighted, [count, hidden_size]
        for each expert with a count."""
        size, start, outs = self.intermediate_size, 0, []
        for e, count in enumerate(batch.counts):
            if count == 0:
                continue
            gate_up = self._gate_up[e](batch.x[start:start + count])  # [count, 2 * intermediate_size]
            outs.append(self._down[e](cpu_layer_ops.silu_mul_(gate_up[:, :size], gate_up[:, size:])))
            start += count
        return outs

    @staticmethod
    def combine(outs: list[torch.Tensor], batch: ExpertBatch, x: torch.Tensor) -> torch.Tensor:
        """sum over each token's experts of weight * output: [num_tokens, hidden_size]."""
        # Scaled in the weights' dtype (float32 for Mixtral: the in-place product is taken in float32 and
        # rounded once), then added in the model dtype onto zeros one expert after another, in ascending
        # order, as HF's index_add_ per expert does. In place and expert by expert: a combine over all rows
        # at once (one concatenation, one gather by token) measured slower, its copies larger than the loop.
        out = torch.zeros_like(x)
        start = 0
        for y, count in zip(outs, (c for c in batch.counts if c)):
            rows = slice(start, start + count)
            out.index_add_(0, batch.tokens[rows], y.mul_(batch.weights[rows, None]).to(x.dtype))
            start += count
        return out


class SparseMoE(nn.Module):
    """Router (`gate`, HF's name) and experts; replaces the dense MLP in a model's sparse layers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.renormalize, self.round_weights = moe.top_k, moe.renormalize, moe.round_weights
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size)
        # Seconds by part (a StepTimer's MoE phases) that this layer adds its time to; None: not timed.
        self.seconds: dict[str, float] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, [num_tokens, top_k] each."""
        logits = self.gate(x)  # [num_tokens, num_experts], in the model dtype
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype) if self.round_weights else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds is not None:
            return self._timed_forward(x)
        return self.experts(x, *self.route(x))

    def _timed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward(), its parts' time added to `seconds`. On CUDA each part is waited for, so that its kernels'
        time is its own; the fused kernel's dispatch and combine count as experts there."""
        seconds, experts = self.seconds, self.experts
        sync = torch.cuda.synchronize if x.device.type == "cuda" else None

        def lap(phase: str, start: float) -> float:
            if sync is not None:
                sync()
            now = time.perf_counter()
            seconds[phase] += now - start
            return now

        start = time.perf_counter()
        ids, weights = self.route(x)
        start = lap("moe_route", start)
        if not experts.groups_on_cpu:
            out = experts(x, ids, weights)
            lap("moe_experts", start)
            return out
        batch = experts.dispatch(x, ids, weights)
        start = lap("moe_dispatch", start)
        y = experts.run(batch)
        start = lap("moe_experts", start)
        out = experts.combine(y, batch, x)
        lap("moe_combine", start)
        return out
