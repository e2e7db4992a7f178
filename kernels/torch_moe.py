"""The PyTorch reference of the experts of a mixture-of-experts MLP (fused_moe.py is its Triton kernel).

Each expert is a gated SiLU MLP over its slices of stacked weights; a token's expert outputs, scaled by
their router weights, are added onto zeros in ascending expert order, as HF transformers adds them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def tokens_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(Every (token, choice) pair's flat index into topk_ids, grouped by expert and in token order within
    each group; how many pairs each expert received)."""
    flat = topk_ids.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts).tolist()


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    gate_up_proj: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size]: gate rows, then up rows
    down_proj: torch.Tensor,  # [num_experts, hidden_size, intermediate_size]
) -> torch.Tensor:
    """sum over each token's top-k experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): [num_tokens, hidden_size]."""
    num_experts, size = gate_up_proj.shape[0], down_proj.shape[2]
    out = torch.zeros_like(x)
    pairs, counts = tokens_by_expert(topk_ids, num_experts)
    tokens, weights = pairs // topk_ids.shape[1], topk_weights.flatten()[pairs]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        gate, up = F.linear(x[rows], gate_up_proj[e]).split(size, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e]) * weights[start:start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out
