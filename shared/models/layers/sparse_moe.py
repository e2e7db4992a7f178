"""The sparse MLP of a mixture-of-experts model (Qwen3-MoE, Mixtral): a top-k router and the experts.

Numerics follow HF transformers: the router's softmax in float32, the top-k probabilities renormalised
where the config says so, each expert a gated SiLU MLP, and a token's expert outputs added in ascending
expert order onto zeros, so that float32 output matches `generate` token for token.
"""
from __future__ import annotations

import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops, torch_moe
from epdserve.shared.config import ModelConfig
from epdserve.shared.models.layers.linear import Linear


class Experts(nn.Module):
    """Every expert's weights stacked, under HF's own names and layout (transformers 5):
    gate_up_proj [num_experts, 2 * intermediate_size, hidden_size] (gate rows, then up rows) and
    down_proj [num_experts, hidden_size, intermediate_size].

    A step groups its tokens by expert and runs each expert that received tokens once, on all of them. On
    CPU each expert's slices run through the packed linear kernel, which is batch-invariant, so a token's
    result does not depend on which tokens share its experts; on CUDA the Triton kernel (fused_moe.py)
    runs every expert in one grouped matmul per projection."""

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

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden_size]; topk_ids, topk_weights: [num_tokens, top_k]."""
        if x.device.type == "cuda":
            from epdserve.kernels.fused_moe import fused_moe

            return fused_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)
        if not self._gate_up:
            return torch_moe.fused_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)
        out = torch.zeros_like(x)
        pairs, counts = torch_moe.tokens_by_expert(topk_ids, self.num_experts)
        tokens, weights = pairs // topk_ids.shape[1], topk_weights.flatten()[pairs]
        size, start = self.intermediate_size, 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            gate_up = self._gate_up[e](x[rows])  # [count, 2 * intermediate_size]
            hidden = cpu_layer_ops.silu_mul_(gate_up[:, :size], gate_up[:, size:])
            # Scaled in the weights' dtype (float32 for Mixtral), then added in the model dtype, as HF does.
            y = self._down[e](hidden) * weights[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, [num_tokens, top_k] each."""
        logits = self.gate(x)  # [num_tokens, num_experts], in the model dtype
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype) if self.round_weights else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.route(x))
