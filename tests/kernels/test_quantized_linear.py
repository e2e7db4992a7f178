"""The Triton quantized linear kernel (on CPU under the interpreter): it computes on exactly the dequantized
checkpoint's weights - multiplied by one-hot rows, it gives back every weight bit for bit - in every layout a
GGUF file or `--quantization int8` gives (4-bit values with and without offsets, bytes, groups of 16 to the whole
row), with tiles cut at the edges, a bias, and bfloat16 activations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import quantized_linear
from epdserve.shared.models.layers.quantized_embedding import QuantizedEmbedding
from epdserve.shared.models.quantized_weight import QuantizedWeight

Q_RANGES = {"int8": (-127, 128), "signed-4-bit": (-8, 8), "unsigned-4-bit": (0, 16)}
# (out_features, in_features, group): whole tiles; N and K cut at the tiles' edges; Q6_K's groups of 16; one group
# a row (int8 per channel).
SHAPES = [(64, 64, 32), (70, 96, 16), (33, 80, 80)]


def quantized_weight(n: int, k: int, group: int, with_offset: bool, q_range, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(*q_range, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.randn(n, k // group, generator=gen) * 0.01
    offset = torch.randn(n, k // group, generator=gen) * 0.1 if with_offset else None
    return QuantizedWeight(q, scale, offset)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_one_hot_rows_give_back_the_dequantized_weight_bit_for_bit(shape, with_offset, q_range):
    n, k, group = shape
    weight = quantized_weight(n, k, group, with_offset, q_range)
    tiles = quantized_linear.pack(weight.q, weight.scale, weight.offset)
    name = next(name for name, r in Q_RANGES.items() if r == q_range)
    assert tiles.zero == {"int8": -1, "signed-4-bit": 8, "unsigned-4-bit": 0}[name] or group % 2
    assert tiles.q.numel() == n * k // (2 if tiles.zero >= 0 else 1)  # 4-bit values two to a byte
    # x = I: y[i, j] = w[j, i] * 1 + zeros, exact whatever the order of the sums.
    got = quantized_linear.linear(torch.eye(k), tiles)
    assert torch.equal(got, weight.dequantize().t())


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_random_rows_give_f_linear_on_the_dequantized_weight(rows, with_offset, q_range):
    n, k, group = 70, 96, 32
    weight = quantized_weight(n, k, group, with_offset, q_range, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(2, rows, k, generator=gen), torch.randn(n, generator=gen)
    tiles = quantized_linear.pack(weight.q, weight.scale, weight.offset)
    w = weight.dequantize()
    # Only the order of the sums differs from torch's matmul.
    torch.testing.assert_close(quantized_linear.linear(x, tiles, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # bfloat16 activations multiply the weights a bfloat16 model holds, w cast from its float32 value (the
    # interpreter truncates where torch rounds: within bfloat16's precision, not bit for bit).
    xb = x.to(torch.bfloat16)
    got = quantized_linear.linear(xb, tiles)
    assert got.dtype == torch.bfloat16
    expected = F.linear(xb.float(), w.to(torch.bfloat16).float())
    assert (got.float() - expected).norm() / expected.norm() < 1e-2
    assert quantized_linear.linear(x[:, :0], tiles).shape == (2, 0, n)


@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_rows_read_back_are_the_weights_rows(with_offset, q_range):
    weight = quantized_weight(50, 64, 32, with_offset, q_range)
    tiles = quantized_linear.pack(weight.q, weight.scale, weight.offset)
    ids = torch.tensor([49, 0, 7, 7, 31])
    q, scale, offset = quantized_linear.quantized_rows(tiles, ids)
    assert torch.equal(q, weight.q[ids]) and torch.equal(scale, weight.scale[ids])
    assert (offset is None) if weight.offset is None else torch.equal(offset, weight.offset[ids])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tied_embedding_looks_its_rows_up_in_the_tiles(dtype):
    weight = quantized_weight(50, 64, 32, True, Q_RANGES["unsigned-4-bit"])
    tiles = quantized_linear.pack(weight.q, weight.scale, weight.offset)
    embedding = QuantizedEmbedding(tiles, 64, dtype)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert embedding.q is None  # held once, in the tiles
    assert torch.equal(embedding(ids), weight.dequantize()[ids].to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_on_cuda_the_weights_are_the_dequantized_ones_bit_for_bit(q_range):
    """Compiled for the GPU without fused multiply-adds: each weight rounded as the reference dequantizer does."""
    weight = quantized_weight(1536, 576, 32, True, q_range)
    tiles = quantized_linear.pack(*(t.cuda() for t in (weight.q, weight.scale, weight.offset)))
    w = weight.dequantize().cuda()
    assert torch.equal(quantized_linear.linear(torch.eye(576, device="cuda"), tiles), w.t())
    x = torch.randn(16, 576, device="cuda")
    torch.testing.assert_close(quantized_linear.linear(x, tiles), F.linear(x, w), rtol=1e-4, atol=1e-4)
