"""The PyTorch attention backend (the engine's CPU path) on the engine's own head-major cache layout, against
dense attention on gathered K/V: mixed decode/prefill/chunked batches, GQA, sliding windows (one step's plan
shared by layers of different windows)."""
import pytest
import torch

from epdserve.kernels import torch_attention


def head_major_batch(specs, num_heads, num_kv_heads, head_size, block_size, seed):
    """specs: [(q_len, seq_len)]; the cache is stored [num_blocks, num_kv_heads, block_size, head_size]."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for _, n in specs]
    num_blocks = sum(blocks_per_seq) + 2
    storage_k = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g)
    storage_v = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g)
    key_cache, value_cache = storage_k.transpose(1, 2), storage_v.transpose(1, 2)  # logical shape, head-major
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in blocks_per_seq:
        ids = [perm.pop() for _ in range(n)]
        tables.append(ids + ids[-1:] * (max(blocks_per_seq) - n))  # padded with own blocks, as the engine does
    q_lens = [q for q, _ in specs]
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return (query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor([n for _, n in specs], dtype=torch.int32), qsl)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_head_major_reference_equals_dense(num_heads, num_kv_heads, sliding_window, seed):
    specs = [(1, 1), (1, 37), (20, 20), (1, 16), (7, 40), (1, 90), (3, 17)]
    query, kc, vc, tables, seq_lens, qsl = head_major_batch(specs, num_heads, num_kv_heads, 32, 16, seed)
    assert kc.transpose(1, 2).is_contiguous()  # the fast gather path is the one under test
    scale = 32 ** -0.5
    plan = torch_attention.plan_attention(tables, seq_lens, qsl, 16, num_kv_heads, sliding_window)
    out = torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, scale, sliding_window,
                                          out=torch.full_like(query, float("nan")), plan=plan)
    for s, (q_len, n) in enumerate(specs):
        blocks = tables[s, :-(-n // 16)].long()
        k = kc[blocks].flatten(0, 1)[:n]
        v = vc[blocks].flatten(0, 1)[:n]
        dense = torch_attention.dense_causal_attention(query[qsl[s]:qsl[s + 1]], k, v, scale, sliding_window)
        torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], dense, atol=1e-5, rtol=1e-5)
    # Without a plan the function makes the same one itself.
    again = torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, scale, sliding_window)
    assert torch.equal(again, out)


@pytest.mark.parametrize("first, second", [(5, None), (None, 5), (5, 9)])
def test_a_plan_made_from_another_windows_plan_equals_a_fresh_one(first, second):
    """Layers with different windows (Gemma 3's sliding and global ones) share one step's plan but the
    decodes' mask."""
    specs = [(1, 1), (1, 37), (20, 20), (7, 40), (1, 90)]
    query, kc, vc, tables, seq_lens, qsl = head_major_batch(specs, 4, 2, 32, 16, 0)
    base = torch_attention.plan_attention(tables, seq_lens, qsl, 16, 2, first)
    derived = torch_attention.plan_attention(tables, seq_lens, qsl, 16, 2, second, base=base)
    assert derived.sliding_window == second and derived.decode_table is base.decode_table
    out = torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, 0.2, second, plan=derived)
    assert torch.equal(out, torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, 0.2, second))
