"""The CPU attention backend: every query token, decode or prefill, attends straight from the paged KV
cache in a C++ kernel.

The PyTorch backend (torch_attention) gathers each sequence's K/V into a contiguous copy and runs two
batched matmuls whose rows are a GQA group (3 rows for SmolLM2) for a decode, or one
scaled_dot_product_attention per prefill chunk; both run far below the machine's speed at these sizes.
The kernel in csrc/cpu_paged_attention.cpp reads the blocks in place, one query token and KV head at a
time (the head serves its GQA group), and computes in float32 (exact two-pass softmax), whatever the cache
stores (the model's dtype, bfloat16, FP8 or int8 rows with their scales: widened as read). A prefill token
attends to its causal prefix: the kernel is told, per token, how many of its sequence's tokens it sees.

The kernel is built on first use for the CPU it runs on (see cpu_build); where it cannot be built,
`available()` says so and the engine uses the "torch" backend.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from epdserve.kernels import cpu_build, torch_attention


def _extension():
    return cpu_build.load("cpu_paged_attention")


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return _extension() is not None


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """`torch_attention.kv_cache_write`'s contract, one row copy per token and head instead of an index_put; a
    cache narrower than the model (bfloat16, FP8) takes the new rows converted first (FP8 saturating, as torch
    converts), an int8 cache each row quantized by the kernel (as int8_rows.quantize_rows)."""
    key_hm, value_hm = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    if key_hm.is_contiguous() and value_hm.is_contiguous() and value_cache.dtype == key_cache.dtype:
        dtype = key.dtype if key_cache.dtype == torch.int8 else key_cache.dtype
        _extension().write_kv(key.to(dtype).contiguous(), value.to(dtype).contiguous(), key_hm, value_hm,
                              slot_mapping.long())
    else:
        torch_attention.kv_cache_write(key, value, key_cache, value_cache, slot_mapping)


class CpuAttentionPlan(NamedTuple):
    """One step's batch as the kernel needs it, worked out once and shared by all layers: one entry per
    query token."""

    table: torch.Tensor  # [num_seqs, blocks of the longest] int64
    table_rows: torch.Tensor  # [num_tokens] int64: each token's row of `table`
    lens: torch.Tensor  # [num_tokens] int64: how many of its sequence's tokens each attends to


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, num_kv_heads: int, sliding_window: int | None = None,
                   base: CpuAttentionPlan | None = None) -> CpuAttentionPlan:
    """`base`: this step's plan for another sliding window, which serves every window (the kernel is given
    the window in each call)."""
    if base is not None:
        return base
    num_seqs, num_tokens = len(seq_lens), int(query_start_loc[-1])
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if 0 < num_seqs == num_tokens and int(q_lens.min()) == 1:  # a token each (decodes): each sees its whole sequence
        rows, lens = torch.arange(num_seqs), seq_lens.long()
    else:
        rows = torch.repeat_interleave(torch.arange(num_seqs), q_lens, output_size=num_tokens)
        # Token j of a chunk of q tokens ending at position seq_len sees seq_len - q + j + 1 tokens.
        position_in_chunk = torch.arange(num_tokens) - query_start_loc[:-1].long()[rows]
        lens = (seq_lens.long() - q_lens)[rows] + position_in_chunk + 1
    longest = int(seq_lens.max()) if len(seq_lens) else 0
    return CpuAttentionPlan(block_tables[:, :-(-longest // block_size)].long(), rows, lens)


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
    target = out if out.is_contiguous() else torch.empty_like(query)
    _extension().paged_attention(target, query.contiguous(), key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                                 plan.table, plan.table_rows, plan.lens, scale, sliding_window or -1)
    if target is not out:
        out.copy_(target)
    return out
