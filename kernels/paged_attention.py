"""Paged attention for decode, prefill and chunked prefill in one varlen launch.

Each program owns one *query tile* (BLOCK_Q consecutive new tokens of one sequence) and one KV head, and
processes every query head of that KV head at once: the tile's rows are (token, head-in-group) pairs, so
each K/V tile read from the cache serves all GROUP query heads that share it (GQA/MQA). The K/V loop walks
the sequence's cached prefix and new tokens through its block table with an online softmax in float32,
stopping at the tile's last causal position and starting at the sliding window's first one.

Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads), or (num_tokens, num_kv_heads) with one-token
tiles. Sequence s owns the tiles starting at `query_start_loc[s] // BLOCK_Q + s` (at `query_start_loc[s]`
with one-token tiles); that start never decreases with s, so each program finds its sequence by binary
search over query_start_loc and the launcher never reads lengths back from the device. Programs past a
sequence's last tile exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from epdserve.kernels.int8_rows import row_size

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The caches each query dtype reads besides its own (`--kv-cache-dtype`): every value of the float ones is one of
# its own; int8 rows (int8_rows.py) are dequantized in float32 (exactly), then rounded to the query's dtype.
NARROWER_CACHES = {torch.float32: (torch.bfloat16, *_FLOAT8, torch.int8), torch.bfloat16: (*_FLOAT8, torch.int8),
                   torch.float16: (*_FLOAT8, torch.int8)}
_LOG2E = 1.4426950408889634


@triton.jit
def _first_tile(q_start, seq, BLOCK_Q: tl.constexpr):
    # Index of sequence `seq`'s first query tile. A sequence's tiles can straddle BLOCK_Q boundaries of the
    # concatenated tokens: the +seq slack gives each one ceil(q_len / BLOCK_Q) tiles. One-token tiles cannot.
    if BLOCK_Q == 1:
        return q_start
    else:
        return q_start // BLOCK_Q + seq


# num_seqs == 1 must not become a constexpr: it seeds the binary search's loop-carried bound.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    num_seqs,
    sliding_window,  # read only when USE_WINDOW
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt_seq, stride_bt_blk,
    key_scale_ptr,  # INT8_ROWS: the caches as float16 (K, V strides / 2); a row's scale at HEAD_SIZE // 2
    value_scale_ptr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # new tokens per query tile
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # keys per inner iteration, independent of BLOCK_SIZE
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter cannot multiply bfloat16)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps float32 inputs out of TF32
    INT8_ROWS: tl.constexpr,  # the caches hold int8 rows with their scales
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Last sequence whose first tile is <= tile_id; invariant: the answer lies in [lo, hi].
    lo = tl.zeros([], dtype=tl.int32)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = _first_tile(tl.load(query_start_loc_ptr + mid).to(tl.int32), mid, BLOCK_Q)
        owned = mid_first_tile <= tile_id
        lo = tl.where(owned, mid, lo)
        hi = tl.where(owned, hi, mid - 1)
    seq = lo

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = tile_id - _first_tile(q_start, seq, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_cached = seq_len - q_len  # tokens before this step's first new token

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    # Row m of the tile is new token m // GROUP_PAD of the tile, query head m % GROUP_PAD of this KV head.
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M]
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    d_ok = offs_d < HEAD_SIZE
    q_pos = num_cached + tok  # [BLOCK_M] absolute position of each row's token
    row_token = (q_start + tok).to(tl.int64)

    q = tl.load(
        query_ptr + row_token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_PAD]
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, base-2 logits
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys [kv_begin, kv_end) cover every row of the tile: causal end of its last token, window start of
    # its first. kv_end <= seq_len, so no block past the sequence's last is ever read.
    kv_end = num_cached + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(num_cached + q_tile * BLOCK_Q - sliding_window + 1, 0)
    kv_begin = kv_begin // TILE_N * TILE_N

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = key_cache_ptr + kv_head * stride_kh
    v_head_ptr = value_cache_ptr + kv_head * stride_vh
    for tile_start in range(kv_begin, kv_end, TILE_N):
        k_pos = tile_start + offs_n  # [TILE_N]
        k_ok = k_pos < kv_end
        block = tl.load(block_table_row + (k_pos // BLOCK_SIZE) * stride_bt_blk, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k = tl.load(
            k_head_ptr + (block * stride_kb + in_block * stride_ks)[None, :] + offs_d[:, None] * stride_kd,
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            v_head_ptr + (block * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :] * stride_vd,
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        if INT8_ROWS:  # q * scale in float32, exact (the float16 scale sits HEAD_SIZE bytes into the row)
            k_row = kv_head * stride_kh + block * stride_kb + in_block * stride_ks  # in bytes: halve for float16
            v_row = kv_head * stride_vh + block * stride_vb + in_block * stride_vs
            k_scale = tl.load(key_scale_ptr + k_row // 2 + HEAD_SIZE // 2, mask=k_ok, other=0.0)
            v_scale = tl.load(value_scale_ptr + v_row // 2 + HEAD_SIZE // 2, mask=k_ok, other=0.0)
            k = k.to(tl.float32) * k_scale.to(tl.float32)[None, :]
            v = v.to(tl.float32) * v_scale.to(tl.float32)[:, None]
        # A narrower cache (bfloat16 or float8 under float32 queries, float8 under 16-bit ones) is widened to the
        # query's dtype as it is read: exact, and then everything is as with a cache in that dtype.
        k = k.to(query_ptr.dtype.element_ty)
        v = v.to(query_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            k = k.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # A row can see nothing in a tile (window start, padding rows): keep its max finite so that
        # exp2(-inf - max) gives 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Probabilities are rounded to the query's dtype for the second dot, as on the GPU path.
        p = p.to(query_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every stored row sees at least its own token, so l_i > 0 there; padding rows divide by 1.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row_token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# Triton decides when a kernel is defined whether it compiles for the GPU or interprets on CPU tensors.
INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


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

    Same contract as `epdserve.kernels.torch_attention.paged_attention`: decode (one new token per sequence),
    prefill and chunked prefill mix freely in one batch; query token i of sequence s sits at position
    `seq_lens[s] - q_len[s] + i`. Softmax runs in float32 and the result is written in `out`'s dtype
    (allocated like `query` when None). The index tensors are trusted: block ids must be valid for the
    first ceil(seq_lens[s] / block_size) entries of each row, and q_len[s] <= seq_lens[s]. Rows of `out`
    beyond query_start_loc[-1] are left untouched.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sliding_window)
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype not in SUPPORTED_DTYPES or out.device != query.device:
        raise ValueError(
            f"out must be a float tensor shaped like query {tuple(query.shape)} on {query.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    elif any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
        raise ValueError("out must not be an expanded view (a zero stride would make rows overlap)")
    _check_device(query)

    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    int8_rows = key_cache.dtype == torch.int8
    # (Any tensor serves as the unused scale pointers of a float cache.)
    key_scales, value_scales = (key_cache.view(torch.float16), value_cache.view(torch.float16)) if int8_rows \
        else (key_cache, value_cache)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    # More new tokens than sequences means some prefill: wide tiles reuse each K/V tile across tokens.
    # A pure decode batch wastes nothing with one token per tile.
    block_q = 1 if num_tokens <= num_seqs else max(1, 64 // group_pad)
    tile_n = 64 if head_pad <= 64 else 32
    grid = (num_tokens if block_q == 1 else num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E, num_seqs, 0 if sliding_window is None else int(sliding_window),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
        key_scales, value_scales,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None,
        DOT_IN_FP32=INTERPRETED and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or INTERPRETED else "tf32",
        INT8_ROWS=int8_rows,
        num_warps=4 if head_pad <= 64 else 8,
    )
    return out


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sliding_window):
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_size] and key_cache [num_blocks, block_size, "
            f"num_kv_heads, head_size], got {tuple(query.shape)} and {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not one of {SUPPORTED_DTYPES}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (query.dtype, *NARROWER_CACHES[query.dtype]):
        raise ValueError(
            f"key/value cache dtype ({key_cache.dtype}, {value_cache.dtype}) must be query dtype {query.dtype} or "
            f"one of {NARROWER_CACHES[query.dtype]}"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.dtype == torch.int8 and head_size % 2:
        raise ValueError(f"an int8 cache needs an even head_size (its float16 scales), got {head_size}")
    if key_cache.shape[3] != row_size(head_size, key_cache.dtype):
        raise ValueError(f"cache rows of {key_cache.shape[3]} differ from the query's head_size {head_size}"
                         + (" + 2 (an int8 cache's scale)" if key_cache.dtype == torch.int8 else ""))
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t, dim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                         ("query_start_loc", query_start_loc, 1)):
        if t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a {dim}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"block_tables rows ({block_tables.shape[0]}) and query_start_loc length "
            f"({query_start_loc.shape[0]}) must be num_seqs ({num_seqs}) and num_seqs + 1"
        )
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def _check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {tensor.device}; on CPU they run only under the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
