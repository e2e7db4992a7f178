"""Scatter of new tokens' keys and values into the paged KV cache through `slot_mapping`.

One program per token writes all its KV heads at once. A token's slot is `block_id * block_size +
offset_in_block`; -1 marks padding (CUDA-graph batches), which is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from epdserve.kernels.int8_rows import quantize_rows, row_size

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # caches only (`--kv-cache-dtype fp8`)
CACHE_DTYPES = SUPPORTED_DTYPES + FLOAT8_DTYPES + (torch.int8,)  # int8: rows with their scales (int8_rows.py)


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens]
    num_slots,  # num_blocks * block_size
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padding (-1) is skipped; so is any slot outside the cache, which would otherwise write out of bounds.
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)  # [HEADS_PAD, HEAD_PAD]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + in_block * stride_kcs
    v_dst = value_cache_ptr + block * stride_vcb + in_block * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# Triton decides when a kernel is defined whether it compiles for the GPU or interprets on CPU tensors.
INTERPRETED = isinstance(_kv_cache_write_kernel, InterpretedFunction)


def kv_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 = padding, skipped
) -> None:
    """Write each token's key/value into its cache slot, converting to the cache dtype.

    Same contract as `epdserve.kernels.torch_attention.kv_cache_write`, except that a slot outside the cache
    (>= num_blocks * block_size) is skipped like padding where torch_attention raises. Key, value and the
    caches may be strided views (e.g. slices of a fused QKV projection). Slots must be distinct.
    """
    if key.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_size] and key_cache [num_blocks, block_size, "
            f"num_kv_heads, head_size], got {tuple(key.shape)} and {tuple(key_cache.shape)}"
        )
    if value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value {tuple(value.shape)} / value_cache {tuple(value_cache.shape)} must match "
            f"key {tuple(key.shape)} / key_cache {tuple(key_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_size = key.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    for name, t, dtypes in (("key", key, SUPPORTED_DTYPES), ("value", value, SUPPORTED_DTYPES),
                            ("key_cache", key_cache, CACHE_DTYPES), ("value_cache", value_cache, CACHE_DTYPES)):
        if t.dtype not in dtypes:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {dtypes}")
    row = row_size(head_size, key_cache.dtype)
    if tuple(key_cache.shape[2:]) != (num_kv_heads, row):
        raise ValueError(
            f"cache heads/row {tuple(key_cache.shape[2:])} differ from key's {(num_kv_heads, row)} (an int8 "
            "cache's rows hold head_size values and a 2-byte scale)"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens or slot_mapping.dtype not in (
        torch.int32, torch.int64
    ):
        raise ValueError(
            f"slot_mapping must be a [num_tokens={num_tokens}] int32/int64 tensor, "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} must not be an expanded view (a zero stride would make slots overlap)")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if key.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {key.device}; on CPU they run only under the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
    if num_tokens == 0:
        return
    # Converted as torch converts, which is what every other path stores (the interpreter would truncate to
    # bfloat16 where torch and the GPU round to nearest), int8 rows quantized by the reference itself; float8
    # then moves as bytes, int8 rows as rows of head_size + 2.
    if key_cache.dtype == torch.int8:
        key, value, head_size = quantize_rows(key), quantize_rows(value), row
    else:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key_cache.dtype in FLOAT8_DTYPES:
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)

    _kv_cache_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_blocks * block_size,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )
