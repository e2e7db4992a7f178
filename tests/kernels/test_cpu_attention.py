"""The C++ CPU attention kernel against torch_attention, on the engine's head-major cache."""
import platform

import pytest
import torch

from epdserve.kernels import cpu_attention, cpu_build, cpu_levels, torch_attention
from epdserve.kernels.int8_rows import dequantize_rows, quantize_rows
from epdserve.kernels.backend import select_attention_backend

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the C++ kernel cannot be built here")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7
    # Head-major storage, seen through the kernels' logical view, as the engine keeps it.
    storage = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    key_cache, value_cache = storage[0].transpose(1, 2), storage[1].transpose(1, 2)
    order = torch.randperm(num_blocks, generator=gen)  # blocks scattered over the pool
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables, used = [], 0
    for n in seq_lens:
        blocks = order[used:used + -(-n // block_size)].tolist()
        used += len(blocks)
        tables.append(blocks + blocks[-1:] * (max_blocks - len(blocks)))
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens,
                                                                                                 dtype=torch.int32), qsl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Head sizes a multiple of 16 and of 8 take the vector paths (AVX-512, AVX2), 36 the plain loops.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (8, 8, 128), (8, 1, 80), (12, 4, 32),
                                                                (6, 2, 36)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decodes_equal_the_reference(dtype, num_heads, num_kv_heads, head_size, block_size):
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 200]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype)
    scale = head_size ** -0.5
    want = torch_attention.paged_attention(*batch, scale)
    got = cpu_attention.paged_attention(*batch, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("head_size", [64, 36])
def test_a_tokens_result_does_not_depend_on_its_batch(head_size):
    """Bit for bit: a sequence alone equals it in a batch, and a prefill in one chunk equals it in two (a
    disaggregated decode continues from KV another engine computed in other batches)."""
    q_lens, seq_lens = [1, 30, 1], [50, 30, 200]
    query, key_cache, value_cache, tables, lens, qsl = make_batch(q_lens, seq_lens, 9, 3, head_size, 16,
                                                                  torch.float32, seed=5)
    together = cpu_attention.paged_attention(query, key_cache, value_cache, tables, lens, qsl, 0.125)

    def alone(i, rows, seq_len):
        return cpu_attention.paged_attention(query[rows], key_cache, value_cache, tables[i:i + 1],
                                             torch.tensor([seq_len], dtype=torch.int32),
                                             torch.tensor([0, rows.stop - rows.start], dtype=torch.int32), 0.125)

    assert torch.equal(alone(0, slice(0, 1), 50), together[0:1])
    assert torch.equal(alone(2, slice(31, 32), 200), together[31:32])
    chunked = torch.cat([alone(1, slice(1, 13), 12), alone(1, slice(13, 31), 30)])
    assert torch.equal(chunked, together[1:31])


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(window):
    batch = make_batch([1, 1, 1], [3, 50, 130], 8, 2, 64, 16, torch.float32, seed=1)
    torch.testing.assert_close(cpu_attention.paged_attention(*batch, 0.125, window),
                               torch_attention.paged_attention(*batch, 0.125, window), atol=2e-5, rtol=2e-5)


def test_mixed_batch_of_decodes_and_prefill_chunks():
    """Each prefill token (of a chunk over a cached prefix or not) sees its causal prefix; decodes see all."""
    batch = make_batch([1, 7, 1, 20, 1], [33, 40, 1, 20, 90], 9, 3, 64, 16, torch.float32, seed=2)
    plan = cpu_attention.plan_attention(batch[3], batch[4], batch[5], 16, 3)
    assert plan.lens.tolist() == [33, *range(34, 41), 1, *range(1, 21), 90]
    assert plan.table_rows.tolist() == [0] + [1] * 7 + [2] + [3] * 20 + [4]
    torch.testing.assert_close(cpu_attention.paged_attention(*batch, 0.125, plan=plan),
                               torch_attention.paged_attention(*batch, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_prefill_chunks_equal_the_reference(dtype, window):
    """Long chunks, over no prefix and over a cached one, with a sliding window or not."""
    batch = make_batch([70, 33, 1], [70, 100, 17], 8, 2, 64, 16, dtype, seed=4)
    torch.testing.assert_close(cpu_attention.paged_attention(*batch, 0.125, window).float(),
                               torch_attention.paged_attention(*batch, 0.125, window).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_results_land_in_a_given_output():
    batch = make_batch([1, 4, 1], [9, 4, 30], 4, 2, 64, 16, torch.float32, seed=3)
    out = torch.full_like(batch[0], float("nan"))
    cpu_attention.paged_attention(*batch, 0.125, out=out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch_attention.paged_attention(*batch, 0.125), atol=2e-5, rtol=2e-5)


def test_block_ids_outside_the_pool_are_refused():
    query, key_cache, value_cache, tables, lens, qsl = make_batch([1], [20], 4, 2, 64, 16, torch.float32)
    tables[0, 1] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match="block ids out of range"):
        cpu_attention.paged_attention(query, key_cache, value_cache, tables, lens, qsl, 0.125)


def test_auto_picks_the_kernel_on_cpu():
    assert select_attention_backend("auto", "cpu").name == "cpu"
    assert select_attention_backend("cpu", "cpu").attend is cpu_attention.paged_attention
    with pytest.raises(RuntimeError, match="CPU device"):
        select_attention_backend("cpu", "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    storage = torch.zeros(2, 2, 10, 3, 16, 64, dtype=dtype)  # [ours/reference, K/V, blocks, heads, block, dim]
    caches = [(s[0].transpose(1, 2), s[1].transpose(1, 2)) for s in storage]
    key, value = torch.randn(2, 7, 3, 64, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 16, 17, 159, 80, -1])
    cpu_attention.kv_cache_write(key, value, *caches[0], slots)
    torch_attention.kv_cache_write(key, value, *caches[1], slots)
    assert torch.equal(storage[0], storage[1]) and storage[0].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_attention.kv_cache_write(key, value, *caches[0], torch.full((7,), 160))


NARROW_CACHES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


# Every level of prebuilt kernels this CPU runs (AVX-512 and AVX2 on an AVX-512 machine).
LEVELS = [lv for lv in cpu_levels.LEVELS
          if lv.machine == platform.machine() and lv.cpu_flags <= cpu_levels.cpu_flags()]


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
@pytest.mark.parametrize("query_dtype, cache_dtype", [(q, c) for q in (torch.float32, torch.bfloat16)
                                                      for c in NARROW_CACHES if c != q], ids=str)
# 64: the vector paths' unrolled loops, 80: their run-time head size, 36: the plain loops.
@pytest.mark.parametrize("head_size", [64, 80, 36])
def test_a_narrower_cache_equals_its_values_widened(level, query_dtype, cache_dtype, head_size):
    """--kv-cache-dtype: a cache stored narrower than the query gives exactly what the query's own dtype gives on
    the same values (each is widened exactly as read, then the arithmetic is the same), decodes and a prefill."""
    kernel = cpu_build.load_prebuilt("cpu_paged_attention", level)
    q_lens, seq_lens = [1, 1, 1, 40], [1, 17, 200, 57]
    query, key_cache, value_cache, tables, lens, qsl = make_batch(q_lens, seq_lens, 9, 3, head_size, 16,
                                                                  torch.float32, seed=3)
    key_cache.mul_(30)  # values a wide range apart, FP8 saturation included (E4M3's largest is 448)
    plan = cpu_attention.plan_attention(tables, lens, qsl, 16, 3)
    query = query.to(query_dtype)

    def attend(dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty_like(query)
        caches = [c.transpose(1, 2).contiguous().to(cache_dtype).to(dtype) for c in (key_cache, value_cache)]
        kernel.paged_attention(out, query, *caches, plan.table, plan.table_rows, plan.lens, 0.125, -1)
        return out

    got = attend(cache_dtype)
    assert got.dtype == query_dtype and torch.isfinite(got).all()
    assert torch.equal(got, attend(query_dtype))


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES)
def test_kv_cache_write_converts_to_a_narrower_cache(cache_dtype):
    """New rows land converted as torch converts them (FP8 saturating), the same as the reference path."""
    gen = torch.Generator().manual_seed(6)
    storage = torch.zeros(2, 2, 10, 3, 16, 64, dtype=cache_dtype)
    caches = [(s[0].transpose(1, 2), s[1].transpose(1, 2)) for s in storage]
    key, value = torch.randn(2, 7, 3, 64, generator=gen) * 300
    slots = torch.tensor([5, -1, 16, 17, 159, 80, -1])
    cpu_attention.kv_cache_write(key, value, *caches[0], slots)
    torch_attention.kv_cache_write(key, value, *caches[1], slots)
    assert torch.equal(storage[0].view(torch.uint8), storage[1].view(torch.uint8))
    written = caches[0][0][0, 5].float()  # block 0, offset 5: token 0's key
    assert torch.equal(written, key[0].to(cache_dtype).float())
    assert torch.isfinite(written).all()


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 36])
def test_an_int8_cache_equals_its_rows_dequantized(level, query_dtype, head_size):
    """--kv-cache-dtype int8: rows of int8 values and their scale give exactly what a float32 cache holding the
    dequantized values gives (each value q * scale, exact in float32, then the float32 arithmetic), on the vector
    paths and the plain loops, decodes and a prefill; the kernel's reference path (torch) agrees closely."""
    kernel = cpu_build.load_prebuilt("cpu_paged_attention", level)
    q_lens, seq_lens = [1, 1, 1, 40], [1, 17, 200, 57]
    query, key_cache, value_cache, tables, lens, qsl = make_batch(q_lens, seq_lens, 9, 3, head_size, 16,
                                                                  torch.float32, seed=3)
    key_cache.mul_(30)
    key_cache[0, :, 1].zero_()  # an all-zero row: scale 0
    plan = cpu_attention.plan_attention(tables, lens, qsl, 16, 3)
    query = query.to(query_dtype)
    rows = [quantize_rows(c.transpose(1, 2)).contiguous() for c in (key_cache, value_cache)]  # head-major
    assert rows[0].shape[-1] == head_size + 2 and rows[0].dtype == torch.int8

    def attend(q, caches) -> torch.Tensor:
        out = torch.empty_like(q)
        kernel.paged_attention(out, q, *caches, plan.table, plan.table_rows, plan.lens, 0.125, -1)
        return out

    got = attend(query, rows)
    assert got.dtype == query_dtype and torch.isfinite(got).all()
    # The query widened to float32 as the kernel widens it; a bfloat16 query's result is the float32 one rounded.
    in_float32 = attend(query.float(), rows)
    assert torch.equal(got, in_float32.to(query_dtype))
    assert torch.equal(in_float32, attend(query.float(), [dequantize_rows(r) for r in rows]))
    reference = torch_attention.paged_attention(query.float(), *(r.transpose(1, 2) for r in rows), tables, lens, qsl,
                                                0.125)
    # (Keys 30x larger make scores large: float32 sums in another order differ by more than at unit scale.)
    torch.testing.assert_close(in_float32, reference, atol=1e-4, rtol=1e-3)


def test_kv_cache_write_quantizes_each_row_as_the_reference():
    """int8 rows land as int8_rows.quantize_rows writes them, byte for byte, from float32 and bfloat16 keys,
    whichever tokens share the call: a row's bytes depend on it alone."""
    gen = torch.Generator().manual_seed(6)
    key, value = torch.randn(2, 7, 3, 64, generator=gen) * 300
    key[3, 1] = 0.0
    slots = torch.tensor([5, -1, 16, 17, 159, 80, -1])
    for dtype in (torch.float32, torch.bfloat16):
        storage = torch.zeros(3, 2, 10, 3, 16, 66, dtype=torch.int8)
        caches = [(s[0].transpose(1, 2), s[1].transpose(1, 2)) for s in storage]
        cpu_attention.kv_cache_write(key.to(dtype), value.to(dtype), *caches[0], slots)
        torch_attention.kv_cache_write(key.to(dtype), value.to(dtype), *caches[1], slots)
        for t in range(7):  # one token at a time
            cpu_attention.kv_cache_write(key[t:t + 1].to(dtype), value[t:t + 1].to(dtype), *caches[2], slots[t:t + 1])
        assert torch.equal(storage[0], storage[1]) and torch.equal(storage[0], storage[2]) and storage[0].any()
        assert torch.equal(caches[0][0][0, 5], quantize_rows(key[0].to(dtype)))  # block 0, offset 5: token 0's key
        assert not caches[0][0][1, 1, 1].any()  # slot 17, head 1: an all-zero row, scale 0
        error = (dequantize_rows(caches[0][0][0, 5]) - key[0].to(dtype).float()).abs()
        assert (error <= key[0].to(dtype).float().abs().amax(-1, keepdim=True) / 254 * 1.001).all()


def test_a_narrower_cache_needs_a_float32_or_bfloat16_query():
    query, key_cache, value_cache, *rest = make_batch([1], [5], 4, 2, 64, 16, torch.float16)
    fp8 = [c.to(torch.float8_e4m3fn) for c in (key_cache, value_cache)]
    with pytest.raises(RuntimeError, match="float32 or bfloat16 query"):
        cpu_attention.paged_attention(query, *fp8, *rest, 0.125)
