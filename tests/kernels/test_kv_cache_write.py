"""Triton KV-cache write against torch_attention's, on a NaN-poisoned cache.

Only the slots named by `slot_mapping` may change; padding (-1) and every other slot must stay NaN.
"""
from __future__ import annotations

import pytest
import torch

from epdserve.kernels import torch_attention
from epdserve.kernels.kv_cache_write import kv_cache_write
from epdserve.kernels.paged_attention import paged_attention


def poisoned_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device="cpu"):
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def random_slots(num_tokens, num_slots, num_padding, gen, dtype=torch.int64):
    """Distinct slots in random order, with `num_padding` of them replaced by -1."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots.to(dtype)


def check_write(key, value, key_cache, value_cache, slot_mapping, atol=0.0, rtol=0.0):
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    torch_attention.kv_cache_write(key, value, expected_k, expected_v, slot_mapping)
    kv_cache_write(key, value, key_cache, value_cache, slot_mapping)

    num_kv_heads, head_size = key_cache.shape[2:]
    flat_k = key_cache.reshape(-1, num_kv_heads, head_size)
    flat_v = value_cache.reshape(-1, num_kv_heads, head_size)
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool, device=key.device)
    valid = slot_mapping >= 0
    written[slot_mapping[valid].long()] = True
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all(), "a slot outside slot_mapping changed"
    assert not flat_k[written].isnan().any() and not flat_v[written].isnan().any(), "a mapped slot was not written"
    torch.testing.assert_close(key_cache, expected_k, atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_v, atol=atol, rtol=rtol, equal_nan=True)


# (num_tokens, num_kv_heads, head_size, block_size, num_blocks, num_padding)
SHAPES = [
    (1, 1, 64, 8, 2, 0),
    (13, 3, 80, 8, 5, 2),
    (21, 8, 128, 16, 4, 5),
    (30, 2, 96, 32, 3, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_matches_reference(shape, dtype):
    num_tokens, num_kv_heads, head_size, block_size, num_blocks, num_padding = shape
    gen = torch.Generator().manual_seed(sum(shape))
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    key_cache, value_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, num_padding, gen)
    check_write(key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize(
    "src_dtype, cache_dtype",
    [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
     (torch.bfloat16, torch.float32)],
    ids=str,
)
def test_converts_to_cache_dtype(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(9, 2, 64, generator=gen).to(src_dtype)
    value = torch.randn(9, 2, 64, generator=gen).to(src_dtype)
    key_cache, value_cache = poisoned_cache(3, 8, 2, 64, cache_dtype)
    slots = random_slots(9, 24, 1, gen, dtype=torch.int32)
    # The interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest: one bfloat16 ulp.
    rtol = 2 ** -7 if cache_dtype == torch.bfloat16 else 0.0
    check_write(key, value, key_cache, value_cache, slots, rtol=rtol)


@pytest.mark.parametrize("src_dtype, cache_dtype", [(torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
                                                    (torch.bfloat16, torch.float8_e4m3fn),
                                                    (torch.float32, torch.bfloat16)], ids=str)
def test_a_narrower_cache_holds_what_torch_converts_to(src_dtype, cache_dtype):
    """--kv-cache-dtype: rounded to nearest as torch rounds (float8 saturating), the values every other path
    stores - also under the interpreter, which would truncate to bfloat16 in the kernel."""
    gen = torch.Generator().manual_seed(2)
    key = (torch.randn(9, 2, 64, generator=gen) * 300).to(src_dtype)  # past float8 e4m3's largest, 448, too
    value = torch.randn(9, 2, 64, generator=gen).to(src_dtype)
    key_cache, value_cache = torch.zeros(3, 8, 2, 64, dtype=cache_dtype), torch.zeros(3, 8, 2, 64, dtype=cache_dtype)
    slots = random_slots(9, 24, 1, gen, dtype=torch.int32)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    torch_attention.kv_cache_write(key, value, expected_k, expected_v, slots)
    kv_cache_write(key, value, key_cache, value_cache, slots)
    bits = {1: torch.uint8, 2: torch.int16}[key_cache.element_size()]
    assert torch.equal(key_cache.view(bits), expected_k.view(bits))
    assert torch.equal(value_cache.view(bits), expected_v.view(bits))


def test_strided_inputs_and_cache():
    """Key/value sliced from a fused QKV output; caches interleaved per layer (non-contiguous)."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_heads, num_kv_heads, head_size = 11, 6, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    kv = qkv[:, num_heads * head_size:].view(num_tokens, 2, num_kv_heads, head_size)
    key, value = kv[:, 0], kv[:, 1]
    layered = torch.full((4, 2, 8, num_kv_heads, head_size), float("nan"))  # [num_blocks, k|v, ...]
    key_cache, value_cache = layered[:, 0], layered[:, 1]
    assert not key.is_contiguous() and not key_cache.is_contiguous()
    check_write(key, value, key_cache, value_cache, random_slots(num_tokens, 32, 3, gen))


def test_all_padding_and_empty():
    key_cache, value_cache = poisoned_cache(2, 8, 2, 64, torch.float32)
    key = torch.randn(4, 2, 64)
    kv_cache_write(key, key, key_cache, value_cache, torch.full((4,), -1))
    kv_cache_write(key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    assert key_cache.isnan().all() and value_cache.isnan().all()


def test_slot_outside_cache_is_skipped():
    key_cache, value_cache = poisoned_cache(2, 8, 2, 64, torch.float32)
    key = torch.randn(3, 2, 64)
    kv_cache_write(key, key, key_cache, value_cache, torch.tensor([16, 3, 1 << 40]))
    assert torch.equal(key_cache.view(-1, 2, 64)[3], key[1])
    assert key_cache.view(-1, 2, 64)[torch.arange(16) != 3].isnan().all()


def test_write_then_attend_equals_dense_attention():
    """Prefill writes its K/V, then attends over the cache it wrote: equal to dense causal attention."""
    gen = torch.Generator().manual_seed(3)
    seq_len, num_heads, num_kv_heads, head_size, block_size = 37, 6, 2, 64, 8
    key = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    value = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    query = torch.randn(seq_len, num_heads, head_size, generator=gen)
    block_ids = torch.randperm(7, generator=gen)[:5].to(torch.int32)  # 5 of 7 blocks, shuffled
    positions = torch.arange(seq_len)
    slots = block_ids[positions // block_size].long() * block_size + positions % block_size
    key_cache, value_cache = poisoned_cache(7, block_size, num_kv_heads, head_size, torch.float32)
    kv_cache_write(key, value, key_cache, value_cache, slots)
    out = paged_attention(query, key_cache, value_cache, block_ids.view(1, -1),
                          torch.tensor([seq_len], dtype=torch.int32),
                          torch.tensor([0, seq_len], dtype=torch.int32), 0.125)
    dense = torch_attention.dense_causal_attention(query, key, value, 0.125)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def _bad_inputs():
    key = torch.randn(4, 2, 64)
    key_cache, value_cache = poisoned_cache(2, 8, 2, 64, torch.float32)
    slots = torch.arange(4)
    args = dict(key=key, value=key, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    return {
        "key_2d": dict(args, key=key[:, 0], value=key[:, 0]),
        "value_shape": dict(args, value=key[:3]),
        "cache_heads": dict(args, key_cache=key_cache[:, :, :1], value_cache=value_cache[:, :, :1]),
        "value_cache_shape": dict(args, value_cache=value_cache[:1]),
        "key_dtype": dict(args, key=key.double(), value=key.double()),
        "cache_dtype": dict(args, key_cache=key_cache.int(), value_cache=value_cache.int()),
        "slot_dtype": dict(args, slot_mapping=slots.float()),
        "slot_len": dict(args, slot_mapping=slots[:3]),
        "cache_expanded": dict(args, key_cache=key_cache[:1].expand(2, 8, 2, 64)),
        "device": dict(args, slot_mapping=slots.to("meta")),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_rejects_bad_inputs(name):
    with pytest.raises(ValueError):
        kv_cache_write(**_bad_inputs()[name])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference_on_cuda(dtype):
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_size, block_size, num_blocks = 4096, 8, 128, 16, 512
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    key_cache, value_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, "cuda")
    slots = random_slots(num_tokens, num_blocks * block_size, 100, gen).cuda()
    check_write(key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_int8_cache_holds_the_reference_rows(src_dtype):
    """--kv-cache-dtype int8: each row quantized to its own scale, the bytes int8_rows.quantize_rows writes
    (which the C++ kernel and the torch path write too)."""
    gen = torch.Generator().manual_seed(2)
    key = (torch.randn(9, 2, 64, generator=gen) * 300).to(src_dtype)
    value = torch.randn(9, 2, 64, generator=gen).to(src_dtype)
    key_cache, value_cache = torch.zeros(3, 8, 2, 66, dtype=torch.int8), torch.zeros(3, 8, 2, 66, dtype=torch.int8)
    slots = random_slots(9, 24, 1, gen, dtype=torch.int32)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    torch_attention.kv_cache_write(key, value, expected_k, expected_v, slots)
    kv_cache_write(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v) and key_cache.any()
    with pytest.raises(ValueError, match="2-byte scale"):
        kv_cache_write(key, value, key_cache[..., :64], value_cache[..., :64], slots)
