"""The decode mirror gives exactly the attention of a fresh gather, step after step, through appends,
batch changes and capacity overflows."""
import pytest
import torch

from epdserve.kernels import torch_attention
from epdserve.kernels.decode_mirror import DecodeMirror

BS, HKV, H, D, NUM_BLOCKS = 4, 2, 6, 16, 256


def step(cache, seqs, g, mirror, sliding_window):
    """One decode step for `seqs` {id: [block ids], length}: write each newest token, attend both ways."""
    kc, vc = cache
    ids = list(seqs)
    lens = [seqs[i]["len"] + 1 for i in ids]
    for i, n in zip(ids, lens):
        seqs[i]["len"] = n
        if (n - 1) // BS >= len(seqs[i]["blocks"]):
            seqs[i]["blocks"].append(seqs[i]["free"].pop())
    width = max(len(seqs[i]["blocks"]) for i in ids)
    tables = torch.tensor([seqs[i]["blocks"] + seqs[i]["blocks"][-1:] * (width - len(seqs[i]["blocks"]))
                           for i in ids], dtype=torch.int32)
    slots = torch.tensor([seqs[i]["blocks"][(n - 1) // BS] * BS + (n - 1) % BS for i, n in zip(ids, lens)])
    torch_attention.kv_cache_write(torch.randn(len(ids), HKV, D, generator=g),
                                   torch.randn(len(ids), HKV, D, generator=g), kc, vc, slots)
    query = torch.randn(len(ids), H, D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(ids) + 1, dtype=torch.int32)
    plan = torch_attention.plan_attention(tables, seq_lens, qsl, BS, HKV, sliding_window, mirror=mirror,
                                          seq_ids=tuple(ids), num_layers=1, head_size=D)
    assert plan.mirror is mirror
    with_mirror = torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, 0.25, sliding_window,
                                                  plan=plan)
    fresh = torch_attention.paged_attention(query, kc, vc, tables, seq_lens, qsl, 0.25, sliding_window)
    torch.testing.assert_close(with_mirror, fresh, atol=1e-6, rtol=1e-6)
    return mirror.appending


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_mirror_matches_a_fresh_gather(sliding_window):
    g = torch.Generator().manual_seed(0)
    storage = [torch.randn(NUM_BLOCKS, HKV, BS, D, generator=g) for _ in range(2)]
    cache = tuple(t.transpose(1, 2) for t in storage)  # head-major, as the engine stores it
    free = list(range(NUM_BLOCKS))
    seqs = {f"s{i}": {"blocks": [free.pop()], "len": n, "free": free} for i, n in enumerate((1, 3, 4))}
    mirror = DecodeMirror(max_bytes=1 << 30)
    appended = [step(cache, seqs, g, mirror, sliding_window) for _ in range(5)]
    assert appended == [False, True, True, True, True]
    del seqs["s1"]  # a sequence leaves: rebuild, then append again
    assert [step(cache, seqs, g, mirror, sliding_window) for _ in range(3)] == [False, True, True]
    seqs["s9"] = {"blocks": [free.pop()], "len": 2, "free": free}  # one joins
    assert step(cache, seqs, g, mirror, sliding_window) is False
    # Growing past the capacity (longest + margin) rebuilds once, then appends resume.
    results = [step(cache, seqs, g, mirror, sliding_window) for _ in range(80)]
    assert results.count(False) == 1 and mirror.num_rebuilds == 4


def test_mirror_declines_batches_over_its_budget():
    mirror = DecodeMirror(max_bytes=1024)
    assert not mirror.begin_step(("a",), [100], HKV, D, num_layers=30, block_size=BS)
