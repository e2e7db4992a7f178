"""Batched LoRA for GPUs: the shrink (x A^T) and expand (y += h B^T) kernels, segmented by adapter as in
Punica's SGMV, over the same grouped token lists as torch_lora.py (their reference).

A program takes BLOCK_M tokens of one segment (one adapter) and BLOCK_N of the output columns, gathers the
tokens' rows of x by index and accumulates over K in float32; the expand adds into y's rows in place.
Segments are whole adapters, so a step with many requests of few adapters runs few, full tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, R, K]
    h_ptr,  # [M, R] float32, rows in token_indices order
    token_indices_ptr,  # [M]
    seg_starts_ptr,  # [S + 1]
    seg_slots_ptr,  # [S]
    K, R,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_hm, stride_hr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    mask_m = offs_m < end
    rows = tl.load(token_indices_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :] * stride_hr, acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [M, R] float32
    b_ptr,  # [num_slots, N, R]
    y_ptr,  # [T, N], added into
    token_indices_ptr, seg_starts_ptr, seg_slots_ptr,
    N, R,
    stride_hm, stride_hr,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    mask_m = offs_m < end
    rows = tl.load(token_indices_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < R
        h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :] * stride_hr,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_br,
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(h, b, input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    # The delta is rounded to y's dtype before the add, as the reference does; the add itself in float32,
    # rounded once.
    delta = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _grid(seg_starts: list[int], n: int) -> tuple[int, int, int]:
    longest = max(b - a for a, b in zip(seg_starts, seg_starts[1:]))
    return len(seg_starts) - 1, triton.cdiv(longest, BLOCK_M), triton.cdiv(n, BLOCK_N)


def _segments(seg_starts: list[int], seg_slots: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    if len(seg_starts) != len(seg_slots) + 1 or not seg_slots:
        raise ValueError(f"{len(seg_slots)} segment slots need {len(seg_slots) + 1} starts, got {len(seg_starts)}")
    return (torch.tensor(seg_starts, dtype=torch.int32, device=device),
            torch.tensor(seg_slots, dtype=torch.int32, device=device))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_indices: torch.Tensor, seg_starts: list[int],
                seg_slots: list[int]) -> torch.Tensor:
    """Same contract as torch_lora.lora_shrink: x [T, K], lora_a [num_slots, R, K] -> h [M, R] float32."""
    if x.dim() != 2 or lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and lora_a [num_slots, R, K] disagree: {tuple(x.shape)}, {tuple(lora_a.shape)}")
    starts, slots = _segments(seg_starts, seg_slots, x.device)
    h = torch.empty(token_indices.numel(), lora_a.shape[1], dtype=torch.float32, device=x.device)
    if h.numel():
        _lora_shrink_kernel[_grid(seg_starts, lora_a.shape[1])](
            x, lora_a, h, token_indices, starts, slots, x.shape[1], lora_a.shape[1], *x.stride(), *lora_a.stride(),
            *h.stride(), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, token_indices: torch.Tensor, seg_starts: list[int],
                seg_slots: list[int], y: torch.Tensor) -> None:
    """Same contract as torch_lora.lora_expand: y[token_indices[i]] += h[i] @ lora_b[slot].T, in place."""
    if y.dim() != 2 or lora_b.dim() != 3 or lora_b.shape[1] != y.shape[1] or lora_b.shape[2] != h.shape[1]:
        raise ValueError(f"h [M, R], lora_b [num_slots, N, R] and y [T, N] disagree: {tuple(h.shape)}, "
                         f"{tuple(lora_b.shape)}, {tuple(y.shape)}")
    starts, slots = _segments(seg_starts, seg_slots, y.device)
    if h.numel():
        _lora_expand_kernel[_grid(seg_starts, y.shape[1])](
            h, lora_b, y, token_indices, starts, slots, y.shape[1], h.shape[1], *h.stride(), *lora_b.stride(),
            *y.stride(), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
