"""Batched LoRA in PyTorch: the reference for the Triton kernels (lora_shrink_expand.py) and the CPU's path.

A step's tokens that use an adapter are listed grouped by adapter: `token_indices` [M] holds rows of the
batch, segment s is token_indices[seg_starts[s]:seg_starts[s + 1]] and uses slot seg_slots[s] of the
stacked weights. Tokens without an adapter are in no segment. One matmul pair per segment: the loop runs
over the distinct adapters of the step, never over requests or tokens.
"""
from __future__ import annotations

import torch


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_indices: torch.Tensor, seg_starts: list[int],
                seg_slots: list[int]) -> torch.Tensor:
    """x [T, K], lora_a [num_slots, R, K] -> h [M, R] (float32), row i for batch row token_indices[i]."""
    h = torch.empty(token_indices.numel(), lora_a.shape[1], dtype=torch.float32, device=x.device)
    whole = len(seg_slots) == 1 and token_indices.numel() == x.shape[0]
    for s, slot in enumerate(seg_slots):
        lo, hi = seg_starts[s], seg_starts[s + 1]
        rows = x if whole else x.index_select(0, token_indices[lo:hi])  # one adapter for all: no gather
        torch.matmul(rows.float(), lora_a[slot].float().t(), out=h[lo:hi])
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, token_indices: torch.Tensor, seg_starts: list[int],
                seg_slots: list[int], y: torch.Tensor) -> None:
    """y[token_indices[i]] += h[i] @ lora_b[slot of i].T, in place; h [M, R], lora_b [num_slots, N, R],
    y [T, N] (each batch row in at most one segment)."""
    whole = len(seg_slots) == 1 and token_indices.numel() == y.shape[0]
    for s, slot in enumerate(seg_slots):
        lo, hi = seg_starts[s], seg_starts[s + 1]
        delta = (h[lo:hi] @ lora_b[slot].float().t()).to(y.dtype)
        if whole:
            y.add_(delta)
        else:
            y.index_add_(0, token_indices[lo:hi], delta)
