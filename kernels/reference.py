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


def kv_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 = padding, skipped
) -> None:
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    slots = slots.long()
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V (cached prefix + new tokens).

    The gather is done once per batch (decodes) or once per prefilling sequence, never per token:
    single-token queries are stacked into one batched matmul, which is what batch decode spends on.
    Softmax is computed in float32; the result has the query's dtype.
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


def _attend(
    query: torch.Tensor,  # [num_seqs, q_len, num_heads, head_size] (same q_len for all)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, *]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_seqs, q_len, num_heads, head_size], float32
    num_seqs, q_len, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    # [num_seqs, num_kv_heads, ctx, head_size]: the sequence's K/V gathered from its blocks.
    k = key_cache[table].flatten(1, 2)[:, :max_len].permute(0, 2, 1, 3).float()
    v = value_cache[table].flatten(1, 2)[:, :max_len].permute(0, 2, 1, 3).float()
    # [num_seqs, num_kv_heads, group * q_len, head_size]: query heads of one KV head side by side.
    q = query.float().view(num_seqs, q_len, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * q_len, head_size)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [S, Hkv, G*q_len, ctx]

    key_pos = torch.arange(max_len, device=query.device)
    query_pos = (seq_lens.long() - q_len).unsqueeze(1) + torch.arange(q_len, device=query.device)
    visible = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [S, q_len, ctx]
    if sliding_window is not None:
        visible &= key_pos.view(1, 1, -1) > query_pos.unsqueeze(-1) - sliding_window
    mask = visible.unsqueeze(1).expand(num_seqs, group, q_len, max_len).reshape(num_seqs, 1, group * q_len, max_len)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past a sequence's end (the tail of its last block, padding) may hold anything, NaN included,
    # and 0 * NaN is NaN: clear them rather than trust a zero probability.
    beyond = key_pos.view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1)
    o = torch.matmul(probs, v.masked_fill_(beyond, 0.0))  # [S, Hkv, G*q_len, head_size]
    return o.view(num_seqs, num_kv_heads, group, q_len, head_size).permute(0, 3, 1, 2, 4).reshape(
        num_seqs, q_len, num_heads, head_size
    )


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
