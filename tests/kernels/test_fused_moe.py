"""The Triton experts kernel (interpreted on CPU) against its PyTorch reference, on random routings: experts
that get no token, one token, runs longer than a row block; odd sizes that leave partial tiles."""
from __future__ import annotations

import pytest
import torch

from epdserve.kernels import torch_moe
from epdserve.kernels.fused_moe import fused_moe

# (num_tokens, hidden_size, intermediate_size, num_experts, top_k)
CASES = [(1, 64, 32, 4, 2), (7, 48, 40, 8, 2), (37, 64, 96, 6, 3), (20, 72, 24, 3, 1)]
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def routing(num_tokens, num_experts, top_k, gen, weights_dtype):
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return ids, weights.to(weights_dtype)


def inputs(case, dtype, seed, weights_dtype=None, device="cpu"):
    num_tokens, hidden, size, num_experts, top_k = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * size, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, size, generator=gen) * size ** -0.5).to(dtype)
    ids, weights = routing(num_tokens, num_experts, top_k, gen, weights_dtype or dtype)
    return [t.to(device) for t in (x, ids, weights, gate_up, down)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case, dtype):
    args = inputs(case, dtype, seed=sum(case))
    torch.testing.assert_close(fused_moe(*args), torch_moe.fused_moe(*args), **TOLERANCES[dtype])


def test_float32_router_weights_with_bfloat16_experts():
    """Mixtral scales bfloat16 expert outputs by float32 weights."""
    args = inputs(CASES[2], torch.bfloat16, seed=3, weights_dtype=torch.float32)
    torch.testing.assert_close(fused_moe(*args), torch_moe.fused_moe(*args), **TOLERANCES[torch.bfloat16])


def test_an_expert_with_more_tokens_than_a_row_block():
    x, ids, weights, gate_up, down = inputs((40, 64, 32, 4, 2), torch.float32, seed=5)
    ids[:, 0] = 2  # every token picks expert 2 first: a run of 40 pairs, three row blocks
    ids[:, 1] = torch.where(ids[:, 1] == 2, 3, ids[:, 1])
    torch.testing.assert_close(fused_moe(x, ids, weights, gate_up, down),
                               torch_moe.fused_moe(x, ids, weights, gate_up, down), **TOLERANCES[torch.float32])


def test_no_tokens():
    x, ids, weights, gate_up, down = inputs((1, 64, 32, 4, 2), torch.float32, seed=0)
    assert fused_moe(x[:0], ids[:0], weights[:0], gate_up, down).shape == (0, 64)


def test_rejects_mismatched_shapes():
    x, ids, weights, gate_up, down = inputs((3, 64, 32, 4, 2), torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not stack"):
        fused_moe(x, ids, weights, gate_up, down[:, :, :16])
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, ids, weights[:, :1], gate_up, down)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_on_cuda(dtype):
    args = inputs(CASES[2], dtype, seed=1, device="cuda")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else TOLERANCES[dtype]  # cuBLAS sums otherwise
    torch.testing.assert_close(fused_moe(*args), torch_moe.fused_moe(*args), **tol)
