"""The Triton LoRA shrink/expand kernels against torch_lora's, on batches that mix adapters and none.

Segments of odd lengths (longer than one tile, shorter than one), tokens in shuffled order, ranks and widths
that are not multiples of the tiles, a y that is a strided slice of a wider output."""
from __future__ import annotations

import pytest
import torch

from epdserve.kernels import lora_shrink_expand, torch_lora


def grouped(slot_of_token: torch.Tensor):
    """(token_indices, seg_starts, seg_slots) of the tokens with a slot (>= 0), grouped by slot."""
    order = torch.argsort(slot_of_token, stable=True)
    order = order[slot_of_token[order] >= 0]
    slots, counts = torch.unique_consecutive(slot_of_token[order], return_counts=True)
    starts = [0] + torch.cumsum(counts, 0).tolist()
    return order, starts, slots.tolist()


# (num_tokens, K, R, N, num_slots)
SHAPES = [(1, 64, 8, 96, 2), (37, 128, 16, 200, 4), (70, 96, 48, 64, 3), (19, 40, 4, 33, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_matches_reference(shape, dtype):
    num_tokens, k, r, n, num_slots = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    a = torch.randn(num_slots, r, k, generator=gen) / k ** 0.5
    b = torch.randn(num_slots, n, r, generator=gen)
    # -1: no adapter; the slots in random order through the batch.
    slot_of_token = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    indices, starts, slots = grouped(slot_of_token)
    if not slots:
        pytest.skip("no token drew an adapter")
    wide = torch.randn(num_tokens, n + 7, generator=gen).to(dtype)
    y, expected = wide[:, 3:3 + n], wide[:, 3:3 + n].clone()

    h_ref = torch_lora.lora_shrink(x, a, indices, starts, slots)
    h = lora_shrink_expand.lora_shrink(x, a, indices, starts, slots)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)

    torch_lora.lora_expand(h_ref, b, indices, starts, slots, expected)
    before = wide.clone()
    lora_shrink_expand.lora_expand(h_ref, b, indices, starts, slots, y)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, expected, **tol)
    # Rows without an adapter and the columns outside y are untouched.
    untouched = slot_of_token < 0
    assert torch.equal(wide[untouched], before[untouched])
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + n:], before[:, 3 + n:])


def test_reference_is_the_per_token_sum():
    gen = torch.Generator().manual_seed(1)
    x, a = torch.randn(9, 16, generator=gen), torch.randn(3, 4, 16, generator=gen)
    b = torch.randn(3, 8, 4, generator=gen)
    slot_of_token = torch.tensor([2, -1, 0, 2, 1, -1, 0, 0, 2])
    y = torch.zeros(9, 8)
    indices, starts, slots = grouped(slot_of_token)
    torch_lora.lora_expand(torch_lora.lora_shrink(x, a, indices, starts, slots), b, indices, starts, slots, y)
    for t, s in enumerate(slot_of_token.tolist()):
        want = torch.zeros(8) if s < 0 else b[s] @ (a[s] @ x[t])
        torch.testing.assert_close(y[t], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[0, 1, 1, 3, -1, 0, 3, 3, 1], [2, 2, -1, 2, 4], [1, 0, 1, 0]])
def test_padded_layout_equals_the_reference(slots):
    """The CPU's batched form (slots spanned x longest segment, padded) adds what the per-adapter loop does."""
    gen = torch.Generator().manual_seed(len(slots))
    slot_of_token = torch.tensor(slots)
    x, a, b = torch.randn(len(slots), 24, generator=gen), torch.randn(5, 6, 24, generator=gen), \
        torch.randn(5, 40, 6, generator=gen)
    indices, starts, seg_slots = grouped(slot_of_token)
    y0 = torch.randn(len(slots), 40, generator=gen)
    expected, y = y0.clone(), y0.clone()
    torch_lora.lora_expand(torch_lora.lora_shrink(x, a, indices, starts, seg_slots), b, indices, starts, seg_slots,
                           expected)
    index, valid, lo, _ = torch_lora.padded_layout(indices, starts, seg_slots)
    torch_lora.lora_padded(x, a, b, index, valid, lo, y)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[slot_of_token < 0], y0[slot_of_token < 0])
