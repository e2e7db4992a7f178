"""PyTorch references for the kernels, and the engine's CPU execution path.

KV-cache layout, shared by every backend (and by the transport, which moves whole blocks):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
A token's *slot* is `block_id * block_size + offset_in_block`.

Batches are "varlen": the new tokens of all sequences are concatenated along dim 0 and described by
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths (query_start_loc[0] == 0)
    seq_lens:        [num_seqs] int32, each sequence's total length including its new tokens
    block_tables:    [num_seqs, max_num_blocks_per_seq] int32, physical block ids (padding ignored)
Query token i of sequence s sits at position `seq_lens[s] - q_len[s] + i` and attends causally to every
cached or new token at or before that position (within `sliding_window`, if given).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V (cached prefix + new tokens).

    K/V are gathered once per batch (all single-token queries together: a decode batch is one gather and
    one attention call) or once per prefilling sequence, never per token. Computed in float32; the result
    has the query's dtype. Block-table entries past a sequence's blocks must be valid block ids, and the
    slots they and the tail of its last block cover must hold finite values (they get zero weight, but
    0 * NaN is NaN): the engine pads tables with the sequence's own blocks and zeroes blocks it allocates.
    """
    if out is None:
        out = torch.empty_like(query)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    decode_idx = torch.nonzero(is_decode).flatten()
    if decode_idx.numel():
        token_idx = query_start_loc[:-1][decode_idx].long()
        out[token_idx] = _attend(
            query[token_idx].unsqueeze(1), key_cache, value_cache,
            block_tables[decode_idx], seq_lens[decode_idx], scale, sliding_window,
        ).squeeze(1).to(out.dtype)
    starts, ends = query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()
    for s in torch.nonzero(~is_decode & (q_lens > 0)).flatten().tolist():
        out[starts[s]:ends[s]] = _attend(
            query[starts[s]:ends[s]].unsqueeze(0), key_cache, value_cache,
            block_tables[s:s + 1], seq_lens[s:s + 1], scale, sliding_window,
        ).squeeze(0).to(out.dtype)
    return out


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The K (or V) of each sequence, contiguous: [num_seqs, num_kv_heads, num_blocks * block_size, head_size].

    When the cache is stored head-major ([num_blocks, num_kv_heads, block_size, head_size] memory, seen
    through a transposed view) one head of one block is a contiguous run, so a single index_select lands
    the result in its final layout; any other layout takes a gather plus a transposing copy.
    """
    total_blocks, block_size, num_kv_heads, head_size = cache.shape
    num_seqs = block_tables.shape[0]
    table = block_tables[:, :num_blocks].long()
    head_major = cache.transpose(1, 2)
    if head_major.is_contiguous():
        rows = (table.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads, device=cache.device).view(1, -1, 1))
        flat = head_major.view(total_blocks * num_kv_heads, block_size * head_size)
        return flat.index_select(0, rows.flatten()).view(num_seqs, num_kv_heads, num_blocks * block_size, head_size)
    return cache[table].flatten(1, 2).transpose(1, 2).contiguous()


def _attend(
    query: torch.Tensor,  # [num_seqs, q_len, num_heads, head_size] (same q_len for all)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, *]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_seqs, q_len, num_heads, head_size], float32
    num_seqs, q_len = query.shape[:2]
    block_size = key_cache.shape[1]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    ctx = num_blocks * block_size
    k = gather_kv(key_cache, block_tables, num_blocks).float()
    v = gather_kv(value_cache, block_tables, num_blocks).float()
    key_pos = torch.arange(ctx, device=query.device)
    query_pos = (seq_lens.long() - q_len).unsqueeze(1) + torch.arange(q_len, device=query.device)
    visible = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [S, q_len, ctx]
    if sliding_window is not None:
        visible &= key_pos.view(1, 1, -1) > query_pos.unsqueeze(-1) - sliding_window
    o = F.scaled_dot_product_attention(query.float().transpose(1, 2), k, v, attn_mask=visible.unsqueeze(1),
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key: torch.Tensor,  # [ctx, num_kv_heads, head_size]
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain attention on contiguous K/V (no blocks), the last q_len tokens being the queries.

    A second, independent reference: paged results must equal it on the gathered K/V.
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
