"""The experts of a mixture-of-experts MLP on the GPU: two grouped matmuls over every expert at once.

The step's (token, choice) pairs are sorted by expert and each expert's run padded to a multiple of
BLOCK_M, so that every row block of the grouped matmul belongs to one expert. One launch computes every
pair's gate and up projections (gathering its token's row of x), SiLU-and-multiply runs in PyTorch, and a
second launch computes the down projections scaled by the router weights; each token then sums its top_k
rows. Same contract as torch_moe.fused_moe, up to float rounding (the sum is over top-k choices, not in
expert order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from epdserve.kernels.torch_moe import tokens_by_expert

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16  # pairs per row block; decode steps give each expert few tokens
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,  # [num_a_rows, K]
    b_ptr,  # [num_experts, N, K]
    c_ptr,  # [num_pairs, N]
    pair_ids_ptr,  # [num_blocks * BLOCK_M] int64: the pair in each padded slot, -1 for padding
    block_expert_ptr,  # [num_blocks] int64: the expert of each row block
    scale_ptr,  # [num_pairs]: each pair's router weight (HAS_SCALE)
    N, K,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    ROW_DIV: tl.constexpr,  # a pair's row of A is pair // ROW_DIV (top_k: its token's row of x; 1: its own)
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter cannot multiply bfloat16)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps float32 inputs out of TF32
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid_m = pairs >= 0
    pairs = tl.where(valid_m, pairs, 0)
    a_rows = pairs // ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=valid_m[:, None] & (kk[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid_m, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=valid_m[:, None] & (offs_n[None, :] < N))


# Triton decides when a kernel is defined whether it compiles for the GPU or interprets on CPU tensors.
INTERPRETED = isinstance(_grouped_matmul_kernel, InterpretedFunction)


def _padded_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids grouped by expert, each expert's run padded with -1 to a multiple of BLOCK_M; the expert of
    each BLOCK_M row block)."""
    device = topk_ids.device
    pairs, counts = tokens_by_expert(topk_ids, num_experts)
    counts = torch.tensor(counts, device=device)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts, padded_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    experts = topk_ids.flatten()[pairs]
    slots = padded_starts[experts] + torch.arange(len(pairs), device=device) - starts[experts]
    pair_ids = torch.full((int(padded.sum()),), -1, dtype=torch.int64, device=device)
    pair_ids[slots] = pairs
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // BLOCK_M)
    return pair_ids, block_expert


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, pair_ids: torch.Tensor, block_expert: torch.Tensor,
                    num_pairs: int, row_div: int, scale: torch.Tensor | None) -> torch.Tensor:
    """c[p] = a[p // row_div] @ b[expert of p].T (* scale[p]): [num_pairs, N]."""
    n, k = b.shape[1], b.shape[2]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (len(block_expert), triton.cdiv(n, BLOCK_N))
    _grouped_matmul_kernel[grid](
        a, b, c, pair_ids, block_expert, scale if scale is not None else c, n, k,
        *a.stride(), *b.stride(), *c.stride(),
        ROW_DIV=row_div, HAS_SCALE=scale is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_IN_FP32=INTERPRETED and a.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or INTERPRETED else "tf32",
        num_warps=4,
    )
    return c


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    gate_up_proj: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size]: gate rows, then up rows
    down_proj: torch.Tensor,  # [num_experts, hidden_size, intermediate_size]
) -> torch.Tensor:
    """sum over each token's top-k experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): [num_tokens, hidden_size]."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0] \
            or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"x must be [num_tokens, hidden] and topk_ids, topk_weights [num_tokens, top_k], got "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    num_tokens, hidden = x.shape
    num_experts, size = gate_up_proj.shape[0], down_proj.shape[2]
    if gate_up_proj.shape != (num_experts, 2 * size, hidden) or down_proj.shape != (num_experts, hidden, size):
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not "
                         f"stack {num_experts} experts of hidden size {hidden}")
    if x.dtype not in SUPPORTED_DTYPES or gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise ValueError(f"x and the weights must share one of {SUPPORTED_DTYPES}, got {x.dtype}, "
                         f"{gate_up_proj.dtype}, {down_proj.dtype}")
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"Triton kernels need CUDA tensors, got {x.device}; on CPU they run only under the "
                         "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    pair_ids, block_expert = _padded_pairs(topk_ids, num_experts)
    gate_up = _grouped_matmul(x, gate_up_proj, pair_ids, block_expert, num_pairs, top_k, None)
    hidden_states = (F.silu(gate_up[:, :size]) * gate_up[:, size:]).contiguous()  # [num_pairs, size]
    weights = topk_weights.flatten().contiguous()
    down = _grouped_matmul(hidden_states, down_proj, pair_ids, block_expert, num_pairs, 1, weights)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
