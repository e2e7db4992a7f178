"""The CPU attention backend: decodes read straight from the paged KV cache by a C++ kernel.

A decode step attends each sequence's single new token to its whole context. The PyTorch backend (torch_attention) does
that with a gather (or a mirror of last step's gather) and two batched matmuls whose rows are a GQA
group, 3 rows for SmolLM2, which run far below the machine's speed; the kernel in
csrc/cpu_decode_attention.cpp reads each sequence's K/V blocks in place, once, for every query head (a KV
head serves its GQA group), and computes in float32 (exact two-pass softmax). Prefill chunks keep the
PyTorch path (one fused scaled_dot_product_attention per sequence).

The kernel is built on first use for the CPU it runs on (see cpu_build); where it cannot be built,
`available()` says so and the engine uses the "torch" backend.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from epdserve.kernels import cpu_build, torch_attention


def _extension():
    return cpu_build.load("cpu_decode_attention.cpp")


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return _extension() is not None


class CpuAttentionPlan(NamedTuple):
    """One step's batch as the kernel needs it, worked out once and shared by all layers."""

    block_size: int
    num_kv_heads: int
    sliding_window: int | None
    decode_token_idx: torch.Tensor | None  # [num_decodes] rows of the single-token queries
    decode_table: torch.Tensor | None  # [num_decodes, num_blocks] int64
    decode_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[tuple[int, int, int, int]]  # (first token, end token, seq_len, row of the block table)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, num_kv_heads: int, sliding_window: int | None = None) -> CpuAttentionPlan:
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    decode_idx = torch.nonzero(is_decode).flatten()
    token_idx = table = lens = None
    if decode_idx.numel():
        token_idx = query_start_loc[:-1][decode_idx].long()
        lens = seq_lens[decode_idx].long()
        table = block_tables[decode_idx, :-(-int(lens.max()) // block_size)].long()
    starts, ends, lens_list = query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), seq_lens.tolist()
    prefills = [(starts[s], ends[s], lens_list[s], s) for s in torch.nonzero(~is_decode & (q_lens > 0)).flatten().tolist()]
    return CpuAttentionPlan(block_size, num_kv_heads, sliding_window, token_idx, table, lens, prefills)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], a view of head-major memory
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    """`torch_attention.paged_attention`'s contract (see there); the cache must be stored head-major."""
    if out is None:
        out = torch.empty_like(query)
    _, block_size, num_kv_heads, _ = key_cache.shape
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, sliding_window)
    if plan.decode_token_idx is not None:
        target = out if out.is_contiguous() else torch.empty_like(query)
        _extension().decode_attention(target, query.contiguous(), plan.decode_token_idx, key_cache.transpose(1, 2),
                                      value_cache.transpose(1, 2), plan.decode_table, plan.decode_lens, scale,
                                      sliding_window or -1)
        if target is not out:
            out[plan.decode_token_idx] = target[plan.decode_token_idx]
    for start, end, seq_len, row in plan.prefills:
        out[start:end] = torch_attention._prefill(query[start:end], key_cache, value_cache, block_tables[row],
                                                  seq_len, scale, sliding_window).to(out.dtype)
    return out
