"""Triton paged attention against torch_attention's paged attention and against dense attention on gathered K/V.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py), so shapes stay small.
Every cache slot that no sequence owns (tails of partial blocks, spare blocks, block-table padding)
holds NaN for the kernel: a kernel that reads past a sequence's end returns NaN and fails.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epdserve.kernels import torch_attention
from epdserve.kernels.int8_rows import dequantize_rows, quantize_rows
from epdserve.kernels.paged_attention import paged_attention

# Per dtype (atol, rtol) against float32 references rounded to the dtype. float16/bfloat16 allow a few
# units in the last place at |out| ~ 2: the kernel rounds the softmax probabilities to the cache dtype
# before P @ V, and the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest.
# Observed worst absolute errors over the cases below: 1.2e-6, 2.0e-3 (1 ulp at 2) and 1.6e-2 (1 ulp at 2).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}
DTYPES = list(TOLERANCES)


class Batch(NamedTuple):
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]; NaN where no token lives
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with a NaN-filled block's id
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_size], the K it attends to
    values: list[torch.Tensor]


def make_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, device="cpu") -> Batch:
    """specs: [(q_len, seq_len)] per sequence. Blocks are shuffled over a pool with spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = perm.pop()  # spare block that pads every block table
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(specs), max_blocks), nan_block, dtype=torch.int32)
    keys, values = [], []
    for s, (_, seq_len) in enumerate(specs):
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        ids = [perm.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for i, block in enumerate(ids):
            chunk = slice(i * block_size, min((i + 1) * block_size, seq_len))
            n = chunk.stop - chunk.start
            key_cache[block, :n], value_cache[block, :n] = k[chunk], v[chunk]
        keys.append(k)
        values.append(v)
    q_lens = [q_len for q_len, _ in specs]
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([seq_len for _, seq_len in specs], dtype=torch.int32)
    tensors = [t.to(device) for t in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)]
    return Batch(*tensors, keys, values)


def check_batch(batch: Batch, sliding_window=None, scale=None) -> None:
    """Run the kernel into a NaN-poisoned `out` and compare it with both references."""
    head_size = batch.query.shape[-1]
    scale = head_size ** -0.5 if scale is None else scale
    atol, rtol = TOLERANCES[batch.query.dtype]
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale, sliding_window, out,
    )
    assert result is out
    assert not out.isnan().any(), "some output elements were never written (or read unowned slots)"

    # The paged reference multiplies zero probabilities by the unowned slots, so it gets a NaN-free cache.
    expected = torch_attention.paged_attention(
        batch.query, batch.key_cache.nan_to_num(0.0), batch.value_cache.nan_to_num(0.0), batch.block_tables,
        batch.seq_lens, batch.query_start_loc, scale, sliding_window,
    )
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)

    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        if starts[s + 1] == starts[s]:
            continue
        dense = torch_attention.dense_causal_attention(
            batch.query[starts[s]:starts[s + 1]].cpu(), k, v, scale, sliding_window
        )
        torch.testing.assert_close(out[starts[s]:starts[s + 1]].cpu(), dense, atol=atol, rtol=rtol)


# Batch shapes: (q_len, seq_len) per sequence, drawn from a seeded RNG. Lengths cross block boundaries,
# so last blocks are partial; every kind has a sequence of length 1 or a single decode token.
def decode_specs(rng: random.Random):
    return [(1, 1)] + [(1, rng.randint(2, 70)) for _ in range(rng.randint(2, 4))]


def prefill_specs(rng: random.Random):
    return [(1, 1)] + [(n, n) for n in (rng.randint(2, 40) for _ in range(2))]


def chunked_specs(rng: random.Random):
    specs = []
    for _ in range(3):
        seq_len = rng.randint(3, 60)
        specs.append((rng.randint(2, seq_len - 1), seq_len))
    return specs


def mixed_specs(rng: random.Random):
    # A sequence with no new tokens this step (q_len 0) must be skipped, not break its neighbours' tiles.
    chunk_len = rng.randint(20, 50)
    return [
        (1, rng.randint(2, 45)),
        (rng.randint(2, 30), rng.randint(2, 30)),
        (0, rng.randint(1, 20)),
        (1, 1),
        (rng.randint(2, chunk_len - 1), chunk_len),
        (1, rng.randint(2, 45)),
    ]


def fix_prefill(specs):
    return [(min(q_len, seq_len), seq_len) for q_len, seq_len in specs]


SPECS = {"decode": decode_specs, "prefill": prefill_specs, "chunked": chunked_specs,
         "mixed": lambda rng: fix_prefill(mixed_specs(rng))}

# (batch kind, num_heads, num_kv_heads, head_size, block_size): GQA ratios 1, 3 and 8, head sizes 64,
# 128 and the odd 80 / 96 (masked to the next power of two), block sizes 8, 16 and 32.
CASES = [
    ("decode", 4, 4, 64, 16),
    ("decode", 8, 1, 128, 8),
    ("decode", 6, 2, 96, 32),
    ("prefill", 6, 2, 64, 32),
    ("prefill", 8, 1, 80, 16),
    ("chunked", 6, 2, 96, 16),
    ("chunked", 2, 2, 128, 8),
    ("mixed", 6, 2, 80, 8),
    ("mixed", 8, 1, 64, 16),
    ("mixed", 3, 3, 128, 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_references(case, dtype, seed):
    kind, num_heads, num_kv_heads, head_size, block_size = case
    specs = SPECS[kind](random.Random(seed * 1000 + CASES.index(case)))
    check_batch(make_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, seed))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sliding_window", [1, 7, 40])
def test_sliding_window(sliding_window, dtype):
    specs = fix_prefill(mixed_specs(random.Random(sliding_window))) + [(30, 90)]
    check_batch(make_batch(specs, 6, 2, 64, 16, dtype, seed=sliding_window), sliding_window=sliding_window)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    data=st.lists(st.tuples(st.integers(0, 24), st.integers(1, 70)), min_size=1, max_size=5),
    group=st.sampled_from([1, 2, 3, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    block_size=st.sampled_from([8, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 50)),
    seed=st.integers(0, 2**16),
)
def test_random_batches(data, group, num_kv_heads, block_size, sliding_window, seed):
    specs = [(min(q_len, seq_len), seq_len) for q_len, seq_len in data]
    if sum(q_len for q_len, _ in specs) == 0:
        specs[0] = (1, specs[0][1])
    batch = make_batch(specs, group * num_kv_heads, num_kv_heads, 64, block_size, torch.float32, seed)
    check_batch(batch, sliding_window=sliding_window)


@pytest.mark.parametrize("specs", [[(1, 5), (0, 7), (1, 9), (0, 3)], [(0, 4), (2, 6), (0, 4), (0, 3)]])
def test_idle_sequences_with_one_token_tiles(specs):
    """No more new tokens than sequences selects one-token tiles; idle (q_len 0) sequences are skipped."""
    check_batch(make_batch(specs, 4, 2, 64, 8, torch.float32, seed=8))


def test_strided_query_out_and_cache():
    """Query sliced from a fused QKV output, out a strided view, caches interleaved per layer."""
    specs = [(1, 19), (9, 9), (5, 33)]
    batch = make_batch(specs, 6, 2, 64, 16, torch.float32, seed=3)
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, (6 + 2 + 2) * 64)
    qkv[:, :6 * 64] = batch.query.flatten(1)
    query = qkv[:, :6 * 64].view(num_tokens, 6, 64)
    layered = torch.stack([batch.key_cache, batch.value_cache], dim=1)  # [num_blocks, 2, block_size, ...]
    key_cache, value_cache = layered[:, 0], layered[:, 1]
    assert not query.is_contiguous() and not key_cache.is_contiguous()
    out_buffer = torch.full((num_tokens, 6, 2 * 64), float("nan"))
    out = out_buffer[:, :, :64]
    paged_attention(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                    batch.query_start_loc, 0.125, out=out)
    expected = torch_attention.paged_attention(
        batch.query, batch.key_cache.nan_to_num(0.0), batch.value_cache.nan_to_num(0.0), batch.block_tables,
        batch.seq_lens, batch.query_start_loc, 0.125,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out_buffer[:, :, 64:].isnan().all(), "wrote outside the out view"


def test_int64_indices_and_out_dtype():
    batch = make_batch([(3, 20), (1, 7)], 4, 2, 64, 8, torch.bfloat16, seed=4)
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.float32)
    paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables.long(),
                    batch.seq_lens.long(), batch.query_start_loc.long(), 0.125, out=out)
    expected = torch_attention.paged_attention(
        batch.query, batch.key_cache.nan_to_num(0.0), batch.value_cache.nan_to_num(0.0), batch.block_tables,
        batch.seq_lens, batch.query_start_loc, 0.125, out=torch.empty_like(out),
    )
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


def test_rows_past_last_sequence_untouched():
    """A batch padded past query_start_loc[-1] (e.g. to a captured size) leaves the padding alone."""
    batch = make_batch([(2, 10), (1, 5)], 4, 4, 64, 8, torch.float32, seed=5)
    query = torch.cat([batch.query, torch.randn(4, 4, 64)])
    out = torch.full_like(query, float("nan"))
    paged_attention(query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                    batch.query_start_loc, 0.125, out=out)
    assert not out[:3].isnan().any() and out[3:].isnan().all()


def test_empty_batch():
    batch = make_batch([(1, 4)], 4, 4, 64, 8, torch.float32, seed=6)
    query = batch.query[:0]
    out = paged_attention(query, batch.key_cache, batch.value_cache, batch.block_tables[:0],
                          batch.seq_lens[:0], batch.query_start_loc[:1], 0.125)
    assert out.shape == (0, 4, 64)


def _bad_inputs():
    b = make_batch([(2, 10), (1, 5)], 4, 2, 64, 8, torch.float32, seed=7)
    args = dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache, block_tables=b.block_tables,
                seq_lens=b.seq_lens, query_start_loc=b.query_start_loc, scale=0.125)
    return {
        "query_2d": dict(args, query=b.query[:, 0]),
        "value_shape": dict(args, value_cache=b.value_cache[:, :4]),
        "cache_dtype": dict(args, key_cache=b.key_cache.half(), value_cache=b.value_cache.half()),
        "query_dtype": dict(args, query=b.query.double()),
        "head_size": dict(args, query=b.query[:, :, :32]),
        "head_ratio": dict(args, query=b.query[:, :3]),
        "float_block_tables": dict(args, block_tables=b.block_tables.float()),
        "seq_lens_len": dict(args, seq_lens=b.seq_lens[:1]),
        "query_start_loc_len": dict(args, query_start_loc=b.query_start_loc[:2]),
        "window_zero": dict(args, sliding_window=0),
        "out_shape": dict(args, out=torch.empty(3, 4, 32)),
        "out_dtype": dict(args, out=torch.empty(3, 4, 64, dtype=torch.int32)),
        "out_expanded": dict(args, out=torch.empty(1, 4, 64).expand(3, 4, 64)),
        "device": dict(args, seq_lens=b.seq_lens.to("meta")),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_rejects_bad_inputs(name):
    with pytest.raises(ValueError):
        paged_attention(**_bad_inputs()[name])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_references_on_cuda(dtype):
    rng = random.Random(11)
    specs = [(1, rng.randint(1, 3000)) for _ in range(48)]
    specs += [(n, n) for n in (rng.randint(1, 700) for _ in range(4))]
    specs += [(q, q + rng.randint(1, 2000)) for q in (rng.randint(2, 300) for _ in range(4))]
    for num_heads, num_kv_heads, head_size, block_size, window in [
        (9, 3, 64, 16, None), (32, 8, 128, 16, None), (16, 16, 96, 32, None), (32, 4, 128, 64, 256),
    ]:
        batch = make_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=12, device="cuda")
        check_batch(batch, sliding_window=window)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                                                (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=str)
def test_a_narrower_cache_reads_as_its_values_widened(dtype, cache_dtype):
    """--kv-cache-dtype: each value is widened to the query's dtype as it is read (exactly), so a narrower cache
    gives bit for bit what a cache in the query's dtype holding the same values gives."""
    b = make_batch([(1, 9), (5, 5), (3, 20), (1, 1)], 4, 2, 64, 8, dtype, seed=3)
    narrow_k, narrow_v = b.key_cache.to(cache_dtype), b.value_cache.to(cache_dtype)
    args = (b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    narrow = paged_attention(b.query, narrow_k, narrow_v, *args)
    wide = paged_attention(b.query, narrow_k.to(dtype), narrow_v.to(dtype), *args)
    assert not narrow.isnan().any() and torch.equal(narrow, wide)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_int8_cache_reads_as_its_rows_dequantized(dtype):
    """--kv-cache-dtype int8: each value is q * scale in float32, then the query's dtype, so the rows give bit for
    bit what a cache in the query's dtype holding those values gives (float32; bfloat16 closely under the
    interpreter) - token-major or head-major (the engine's)."""
    b = make_batch([(1, 9), (5, 5), (3, 20), (1, 1)], 4, 2, 64, 8, dtype, seed=3)
    # (Wide-ranging keys for float32; under the interpreter a bfloat16 query's test keeps scores small, see below.)
    rows_k, rows_v = quantize_rows(b.key_cache * (30 if dtype == torch.float32 else 1)), quantize_rows(b.value_cache)
    args = (b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    int8 = paged_attention(b.query, rows_k, rows_v, *args)
    wide = paged_attention(b.query, dequantize_rows(rows_k).to(dtype), dequantize_rows(rows_v).to(dtype), *args)
    assert not int8.isnan().any()
    if dtype == torch.float32:
        assert torch.equal(int8, wide)
    else:  # the interpreter truncates the dequantized float32 to bfloat16 where torch (and a GPU) rounds
        torch.testing.assert_close(int8, wide, atol=2e-2, rtol=2e-2)
    head_major = [r.transpose(1, 2).contiguous().transpose(1, 2) for r in (rows_k, rows_v)]
    assert torch.equal(paged_attention(b.query, *head_major, *args), int8)
