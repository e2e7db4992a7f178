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


def padded_layout(token_indices: torch.Tensor, seg_starts: list[int], seg_slots: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The segments laid out for `lora_padded`: every slot from the lowest to the highest used gets `rows`
    rows (the longest segment's length; slots in between with no tokens get none used). Returns
    (padded_index [num_slots_spanned * rows]: the batch row of each, padding pointing at any valid row;
    valid [num_slots_spanned, rows, 1]: 1.0 where a row is real; lowest slot; rows)."""
    lo, hi = seg_slots[0], seg_slots[-1]
    counts = [b - a for a, b in zip(seg_starts, seg_starts[1:])]
    rows = max(counts)
    spanned = hi - lo + 1
    where = torch.cat([torch.arange(n) + (slot - lo) * rows for slot, n in zip(seg_slots, counts)])
    padded = token_indices.new_full((spanned * rows,), int(token_indices[0]))
    padded[where] = token_indices
    valid = torch.zeros(spanned * rows, 1)
    valid[where] = 1.0
    return padded, valid.view(spanned, rows, 1), lo, rows


def lora_padded(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, padded_index: torch.Tensor,
                valid: torch.Tensor, lo: int, y: torch.Tensor) -> None:
    """y[t] += x[t] A^T B^T for every row t of the layout (padded_layout) with its slot's A and B: two
    batched matmuls over the slots spanned, whatever their number (on CPU a loop per adapter costs ~3x more
    at decode sizes, 8 adapters of 8 rows each). Padding rows add exact zeros."""
    spanned, rows = valid.shape[0], valid.shape[1]
    xs = x.index_select(0, padded_index).view(spanned, rows, x.shape[1]).float()
    h = torch.bmm(xs, lora_a[lo:lo + spanned].float().transpose(1, 2)).mul_(valid)
    delta = torch.bmm(h, lora_b[lo:lo + spanned].float().transpose(1, 2)).to(y.dtype)
    y.index_add_(0, padded_index, delta.view(-1, y.shape[1]))
