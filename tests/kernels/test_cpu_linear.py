"""The panel kernel behind Linear on CPU: F.linear's results, batch-invariant rows."""
import platform

import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_build, cpu_levels, cpu_linear
from epdserve.shared.models.layers.linear import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.supports(torch.float32),
                                reason="the kernel cannot be built here (or no AVX-512)")
needs_bf16 = pytest.mark.skipif(not cpu_linear.supports(torch.bfloat16), reason="no AVX-512 BF16 here")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 64, 301])
@pytest.mark.parametrize("out_features, in_features", [(576, 576), (100, 64), (10, 33), (960, 1536)])
def test_equals_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    panels = cpu_linear.pack(weight)
    # Sums of in_features products, in another order than MKL's: a few units in the last place.
    torch.testing.assert_close(cpu_linear.linear(x, panels, out_features, bias), F.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4 * in_features ** 0.5)
    torch.testing.assert_close(cpu_linear.linear(x, panels, out_features, None), F.linear(x, weight),
                               rtol=1e-4, atol=1e-4 * in_features ** 0.5)


# An odd number of panels too: one or two rows then split a panel between two threads (each its half).
@pytest.mark.parametrize("out_features", [1000, 960])
def test_a_row_does_not_depend_on_its_batch(out_features):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 576, generator=gen)
    panels = cpu_linear.pack(weight)
    batch = torch.randn(67, 576, generator=gen)
    alone = torch.cat([cpu_linear.linear(batch[i:i + 1], panels, out_features, None) for i in range(67)])
    assert torch.equal(cpu_linear.linear(batch, panels, out_features, None), alone)
    assert torch.equal(cpu_linear.linear(batch[5:20], panels, out_features, None), alone[5:20])
    assert torch.equal(cpu_linear.linear(batch[5:7], panels, out_features, None), alone[5:7])


def test_strided_rows_and_more_dimensions():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 32, generator=gen)
    panels = cpu_linear.pack(weight)
    fused = torch.randn(2, 9, 3 * 32, generator=gen)
    x = fused[..., 32:64]  # rows of a wider tensor
    got = cpu_linear.linear(x, panels, 70, None)
    assert got.shape == (2, 9, 70)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_layer_uses_the_panels_for_float32_and_repacks():
    layer = Linear(64, 48)
    layer.pack()
    assert layer.panels is not None and layer.packed_weight is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2)
    layer.pack()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("out_features, in_features", [(576, 576), (100, 65), (960, 1536)])
def test_bfloat16_equals_onednn(rows, out_features, in_features):
    """The same products summed in float32 and rounded once: bfloat16 results a rounding apart at most."""
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    want = F.linear(x.float(), weight.float(), bias.float())
    got = cpu_linear.linear(x, cpu_linear.pack(weight), out_features, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], cpu_linear.pack(weight), out_features, bias) for i in range(rows)])
    assert torch.equal(got, alone)


# The q ranges of the formats: bytes (Q8_0, Q6_K's 6 bits), signed nibbles (Q4_0) and unsigned ones (Q4_1, Q4_K).
Q_RANGES = {"int8": (-128, 128), "signed-4-bit": (-8, 8), "unsigned-4-bit": (0, 16)}


def quantized_weight(out_features: int, in_features: int, group: int, with_offset: bool, seed: int,
                     q_range: tuple[int, int] = Q_RANGES["int8"]):
    """(q int8, scale, offset or None) of a random quantized weight, as a GGML format holds one (float16 scales)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(*q_range, (out_features, in_features), generator=gen, dtype=torch.int8)
    groups = in_features // group
    scale = (torch.randn(out_features, groups, generator=gen) * 0.01).half().float()
    offset = (torch.randn(out_features, groups, generator=gen) * 0.1).half().float() if with_offset else None
    return q, scale, offset


def dequantized(q, scale, offset) -> torch.Tensor:
    """w = scale * q (+ offset), each operation rounded to float32 (the reference dequantizer's order)."""
    n, k = q.shape
    groups = scale.shape[1]
    w = q.view(n, groups, k // groups).float() * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.view(n, k)


# More rows than a tile's 6: the panel is unpacked into float32 once, and the float32 tiles run over it. One or two
# rows: AVX2 takes 64 / rows columns at a time, not a strip's 16.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 64])
@pytest.mark.parametrize("out_features, in_features, group", [(576, 576, 32), (100, 64, 16), (130, 512, 256)])
@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_a_quantized_weight_gives_the_float32_kernels_result_on_its_dequantized_weight(rows, out_features,
                                                                                        in_features, group,
                                                                                        with_offset, q_range):
    q, scale, offset = quantized_weight(out_features, in_features, group, with_offset, rows * out_features, q_range)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, in_features, generator=gen), torch.randn(out_features, generator=gen)
    packed = cpu_linear.pack_quantized(q, scale, offset)
    # 4-bit values two to a byte: half the bytes of one a byte (the scales and offsets aside).
    assert packed.zero == {"int8": -1, "signed-4-bit": 8, "unsigned-4-bit": 0}[
        next(name for name, r in Q_RANGES.items() if r == q_range)]
    q_bytes = packed.panels.numel() - packed.panels.shape[0] * scale.shape[1] * 64 * 4 * (2 if with_offset else 1)
    assert q_bytes == -(-out_features // 64) * 64 * in_features // (2 if packed.zero >= 0 else 1)
    expected = cpu_linear.linear(x, cpu_linear.pack(dequantized(q, scale, offset)), out_features, bias)
    assert torch.equal(cpu_linear.linear_quantized(x, packed, out_features, bias), expected)
    assert torch.equal(cpu_linear.linear_quantized(x[None], packed, out_features, bias), expected[None])  # [1, M, K]


def test_a_weight_whose_fused_unpacking_would_round_otherwise_is_refused():
    """The kernel unpacks a weight with offset as one fused multiply-add: equal to the dequantizer's multiply
    then add only where each product is exact, as with GGUF's float16 scales - not with any float32 scale."""
    q, scale, offset = quantized_weight(64, 64, 32, True, 0)
    assert cpu_linear.unpacks_exactly(q, scale, offset)
    wide = scale + scale * 2.0 ** -20  # significands no longer end in zeros
    with pytest.raises(ValueError, match="not exact"):
        cpu_linear.pack_quantized(q, wide, offset)
    # Without an offset (int8 per channel), or where it is zero, nothing is fused: any scale will do.
    for weight in ((q, wide, None), (q, wide, torch.zeros_like(offset))):
        assert cpu_linear.unpacks_exactly(*weight)
        x = torch.randn(3, 64)
        assert torch.equal(cpu_linear.linear_quantized(x, cpu_linear.pack_quantized(*weight), 64, None),
                           cpu_linear.linear(x, cpu_linear.pack(dequantized(*weight)), 64, None))


@pytest.mark.parametrize("out_features, in_features, group", [(576, 576, 32), (130, 512, 256)])
@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_rows_read_back_from_the_panels_are_the_dequantized_weights_rows(out_features, in_features, group,
                                                                         with_offset, q_range):
    q, scale, offset = quantized_weight(out_features, in_features, group, with_offset, out_features, q_range)
    packed = cpu_linear.pack_quantized(q, scale, offset)
    # Every row of the first and last panel (the last one part padding), repeats, any order.
    rows = torch.tensor([out_features - 1, 0, 63, 64, 5, 5, out_features - 2, *range(0, out_features, 7)])
    want = dequantized(q, scale, offset)[rows]
    assert torch.equal(cpu_linear.dequantized_rows(packed, rows, in_features).view(torch.int32),
                       want.view(torch.int32))
    assert cpu_linear.dequantized_rows(packed, rows[:0], in_features).shape == (0, in_features)
    for outside in (-1, packed.panels.shape[0] * 64):
        with pytest.raises(RuntimeError, match="outside the panels"):
            cpu_linear.dequantized_rows(packed, torch.tensor([0, outside]), in_features)


# Every level of prebuilt kernels this CPU runs (AVX-512 and AVX2 on an AVX-512 machine).
LEVELS = [lv for lv in cpu_levels.LEVELS if lv.machine == platform.machine() and lv.cpu_flags <= cpu_levels.cpu_flags()]


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: lv.name)
# 7 rows: a panel with offsets is unpacked into float32 first, one without is not; 13: both are.
@pytest.mark.parametrize("rows", [1, 2, 7, 13])
# 130 columns: two whole panels and a part of a third, whose last 16-column strip is a part too.
@pytest.mark.parametrize("out_features, in_features, group", [(130, 512, 32), (100, 64, 16)])
@pytest.mark.parametrize("with_offset", [False, True], ids=["scale", "scale-offset"])
@pytest.mark.parametrize("q_range", Q_RANGES.values(), ids=Q_RANGES)
def test_every_cpu_level_gives_the_same_bits(level, rows, out_features, in_features, group, with_offset, q_range):
    """The AVX2 tiles take the AVX-512 ones' steps in the same order: float32 and quantized panels give the
    same bits on every level, so a model's output does not depend on the CPU it runs on."""
    ops = cpu_build.load_prebuilt("cpu_linear", level)
    assert "float32" in ops.dtypes()
    q, scale, offset = quantized_weight(out_features, in_features, group, with_offset, rows, q_range)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, in_features, generator=gen), torch.randn(out_features, generator=gen)
    weight = dequantized(q, scale, offset)
    expected = cpu_linear.linear(x, cpu_linear.pack(weight), out_features, bias)  # this CPU's best level
    assert torch.equal(ops.linear(x, ops.pack(weight), out_features, bias), expected)
    zero = cpu_linear.nibble_zero(q, group)
    panels = ops.pack_quantized(q, scale, offset, zero)
    assert torch.equal(ops.linear_quantized(x, panels, out_features, offset is not None, zero, bias), expected)


def test_nibbles_need_values_that_fit_them():
    q, scale, _ = quantized_weight(64, 64, 32, False, 0, Q_RANGES["unsigned-4-bit"])
    assert cpu_linear.nibble_zero(q, 32) == 0 and cpu_linear.nibble_zero(q - 8, 32) == 8
    assert cpu_linear.nibble_zero(q * 2, 32) == -1 and cpu_linear.nibble_zero(q, 3) == -1  # too wide; odd group
    with pytest.raises(RuntimeError, match="nibbles"):
        cpu_linear._ops().pack_quantized(q - 9, scale, None, 8)
