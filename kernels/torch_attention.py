"""The "torch" attention backend: KV-cache writes and paged attention in plain PyTorch.

This is the engine's CPU path (every step where the C++ decode kernel cannot be built, and prefill chunks
under the "cpu" backend), it runs on CUDA too, and it is what the Triton and C++ kernels are tested against.

KV-cache layout, shared by every backend (and by the transport, which moves whole blocks):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
A token's *slot* is `block_id * block_size + offset_in_block`. An int8 cache (--kv-cache-dtype int8) holds
each row of head_size values quantized to its own scale, the scale's float16 bytes after them: its last
dimension is head_size + 2 (int8_rows.py).

Batches are "varlen": the new tokens of all sequences are concatenated along dim 0 and described by
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths (query_start_loc[0] == 0)
    seq_lens:        [num_seqs] int32, each sequence's total length including its new tokens
    block_tables:    [num_seqs, max_num_blocks_per_seq] int32, physical block ids (padding ignored)
Query token i of sequence s sits at position `seq_lens[s] - q_len[s] + i` and attends causally to every
cached or new token at or before that position (within `sliding_window`, if given).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from epdserve.kernels.decode_mirror import DecodeMirror
from epdserve.kernels.int8_rows import quantize_rows, widened


def kv_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], any strides
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 = padding, skipped
) -> None:
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    slots = slots.long()
    blocks, offsets = slots // block_size, slots % block_size
    if key_cache.dtype == torch.int8:
        key, value = quantize_rows(key), quantize_rows(value)
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


class AttentionPlan(NamedTuple):
    """What a batch's attention needs besides Q/K/V, worked out once per step and shared by all layers."""

    block_size: int
    num_kv_heads: int
    sliding_window: int | None
    # Single-token queries, attended together: their token rows, and for each sequence the rows of its
    # blocks in the head-major cache ([num_decodes * num_kv_heads * num_blocks]).
    decode_token_idx: torch.Tensor | None
    decode_table: torch.Tensor | None  # [num_decodes, num_blocks] their block-table rows
    decode_rows: torch.Tensor | None
    decode_bias: torch.Tensor | None  # [num_decodes * num_kv_heads, 1, ctx]: 0 where visible, -inf elsewhere
    # Multi-token queries, one sequence at a time: (first token, end token, seq_len, blocks row of the table).
    prefills: list[tuple[int, int, int, int]]
    # Set when the decodes' K/V come from a DecodeMirror: it, and the (block, offset, position) of each
    # decode's newest token.
    mirror: DecodeMirror | None = None
    decode_newest: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _decode_bias(lens: torch.Tensor, ctx: int, num_kv_heads: int, sliding_window: int | None) -> torch.Tensor:
    """[num_decodes * num_kv_heads, 1, ctx]: 0 where a decode sees the key, -inf elsewhere."""
    key_pos = torch.arange(ctx, device=lens.device).view(1, -1)
    visible = key_pos < lens.view(-1, 1)
    if sliding_window is not None:
        visible &= key_pos > lens.view(-1, 1) - 1 - sliding_window
    bias = torch.zeros(visible.shape, device=lens.device).masked_fill_(~visible, float("-inf"))
    return bias.repeat_interleave(num_kv_heads, dim=0).unsqueeze(1)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, num_kv_heads: int, sliding_window: int | None = None,
                   mirror: DecodeMirror | None = None, seq_ids: tuple | None = None, num_layers: int = 1,
                   head_size: int = 0, base: AttentionPlan | None = None) -> AttentionPlan:
    """`mirror` with `seq_ids` (one id per sequence) lets decodes reuse last step's gathered K/V. `base`: this
    step's plan for another sliding window (a model whose layers differ in theirs); its indices and mirror
    are shared, only the decodes' mask is made again."""
    device = block_tables.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    decode_idx = torch.nonzero(is_decode).flatten()
    if base is not None:
        if base.decode_bias is None:
            return base._replace(sliding_window=sliding_window)
        lens = seq_lens[decode_idx].long()
        return base._replace(sliding_window=sliding_window,
                             decode_bias=_decode_bias(lens, base.decode_bias.shape[-1], num_kv_heads, sliding_window))
    token_idx = table = rows = bias = newest = None
    if decode_idx.numel():
        token_idx = query_start_loc[:-1][decode_idx].long()
        lens = seq_lens[decode_idx].long()
        num_blocks = -(-int(lens.max()) // block_size)
        table = block_tables[decode_idx, :num_blocks].long()
        rows = (table.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads, device=device).view(1, -1, 1)).flatten()
        ctx = num_blocks * block_size
        if mirror is not None:
            ids = tuple(seq_ids[i] for i in decode_idx.tolist())
            if mirror.begin_step(ids, lens.tolist(), num_kv_heads, head_size, num_layers, block_size):
                ctx = int(lens.max())  # the mirror is contiguous: no need to round up to whole blocks
                positions = lens - 1
                newest = (table.gather(1, (positions // block_size).view(-1, 1)).flatten(), positions % block_size,
                          positions)
            else:
                mirror = None
        bias = _decode_bias(lens, ctx, num_kv_heads, sliding_window)
    starts, ends, lens_list = query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), seq_lens.tolist()
    prefills = [(starts[s], ends[s], lens_list[s], s) for s in torch.nonzero(~is_decode & (q_lens > 0)).flatten().tolist()]
    return AttentionPlan(block_size, num_kv_heads, sliding_window, token_idx, table, rows, bias, prefills,
                         mirror if newest is not None else None, newest)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], any strides
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V (cached prefix + new tokens).

    K/V are gathered once per batch (all single-token queries together: a decode batch is one gather and
    two batched matmuls) or once per prefilling sequence, never per token. Computed in float32; the result
    has the query's dtype. Block-table entries past a sequence's blocks must be valid block ids, and the
    slots they and the tail of its last block cover must hold finite values (they get zero weight, but
    0 * NaN is NaN): the engine pads tables with the sequence's own blocks and zeroes blocks it allocates.
    `plan` (from plan_attention) saves working out the batch's indices again in every layer.
    """
    if out is None:
        out = torch.empty_like(query)
    _, block_size, num_kv_heads, head_size = key_cache.shape
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, sliding_window)
    assert plan.sliding_window == sliding_window and plan.block_size == block_size
    if plan.decode_token_idx is not None:
        out[plan.decode_token_idx] = _decode(query[plan.decode_token_idx], key_cache, value_cache, plan,
                                             scale).to(out.dtype)
    for start, end, seq_len, row in plan.prefills:
        out[start:end] = _prefill(query[start:end], key_cache, value_cache, block_tables[row], seq_len, scale,
                                  sliding_window).to(out.dtype)
    return out


def _head_major_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as [num_blocks * num_kv_heads, block_size * head_size] rows, if stored head-major."""
    total_blocks, block_size, num_kv_heads, head_size = cache.shape
    head_major = cache.transpose(1, 2)
    if not head_major.is_contiguous():
        return None
    return head_major.view(total_blocks * num_kv_heads, block_size * head_size)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """The K (or V) of each sequence, contiguous: [num_seqs, num_kv_heads, num_blocks * block_size, head_size].

    When the cache is stored head-major ([num_blocks, num_kv_heads, block_size, head_size] memory, seen
    through a transposed view) one head of one block is a contiguous run, so a single index_select lands
    the result in its final layout; any other layout takes a gather plus a transposing copy.
    """
    _, block_size, num_kv_heads, head_size = cache.shape
    num_seqs = block_tables.shape[0]
    flat = _head_major_rows(cache)
    if flat is not None:
        if rows is None:
            table = block_tables[:, :num_blocks].long()
            rows = (table.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads, device=cache.device).view(1, -1, 1))
        return flat.index_select(0, rows.flatten()).view(num_seqs, num_kv_heads, num_blocks * block_size, head_size)
    return cache[block_tables[:, :num_blocks].long()].flatten(1, 2).transpose(1, 2).contiguous()


def _decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size], one token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_size], float32
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, group = plan.num_kv_heads, num_heads // plan.num_kv_heads
    num_blocks = plan.decode_table.shape[1]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return widened(gather_kv(cache, plan.decode_table, num_blocks, plan.decode_rows))

    if plan.mirror is not None:
        k, v = plan.mirror.kv(key_cache, value_cache, plan, gather)  # [S * Hkv, ctx, head_size] views
    else:
        ctx = plan.decode_bias.shape[-1]
        k, v = gather(key_cache).view(-1, ctx, head_size), gather(value_cache).view(-1, ctx, head_size)
    # Query heads of one KV head side by side: [num_seqs * num_kv_heads, group, head_size].
    q = query.float().reshape(num_seqs * num_kv_heads, group, head_size)
    scores = torch.baddbmm(plan.decode_bias, q, k.transpose(1, 2), alpha=scale)  # [S * Hkv, group, ctx]
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v).view(num_seqs, num_heads, head_size)


def _prefill(
    query: torch.Tensor,  # [q_len, num_heads, head_size] of one sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_blocks]
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [q_len, num_heads, head_size], float32
    q_len = query.shape[0]
    num_blocks = -(-seq_len // key_cache.shape[1])
    table = block_table.view(1, -1)
    k = widened(gather_kv(key_cache, table, num_blocks)[:, :, :seq_len])
    v = widened(gather_kv(value_cache, table, num_blocks)[:, :, :seq_len])
    q = query.float().transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_size]
    if q_len == seq_len and sliding_window is None:  # nothing cached before: plain causal attention
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        key_pos = torch.arange(seq_len, device=query.device).view(1, -1)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).view(-1, 1)
        visible = key_pos <= query_pos  # [q_len, seq_len]
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key: torch.Tensor,  # [ctx, num_kv_heads, head_size]
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain attention on contiguous K/V (no blocks), the last q_len tokens being the queries.

    An independent check for tests: paged results must equal it on the gathered K/V.
    """
    q_len, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("qhd,hkd->hqk", query.float(), k) * scale
    qpos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
    kpos = torch.arange(ctx, device=query.device).unsqueeze(0)
    visible = kpos <= qpos
    if sliding_window is not None:
        visible &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", torch.softmax(scores, -1), v).to(query.dtype)
