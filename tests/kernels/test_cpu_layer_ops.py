"""The C++ RMSNorm, rotary and SiLU-and-multiply ops against their PyTorch spelling (HF Llama numerics)."""
import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_layer_ops

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(), reason="the C++ ops cannot be built here")


def torch_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rotary(x, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (300, 576), (64, 2048)])
def test_rms_norm(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    got, want = cpu_layer_ops.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    # Only the sum of squares adds up in another order: a few units in the last place.
    tolerance = 4e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 640), (37, 256), (300, 64)])
def test_gemmas_unit_offset_rms_norm_scales_in_float32(dtype, rows, hidden):
    """(1 + weight) * x / rms(x), all in float32, rounded once to the dtype (HF's Gemma3RMSNorm); after the
    residual add, in place."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.5).to(dtype)
    summed = (x.float() + delta.float()).to(dtype)
    x32 = summed.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).to(dtype)
    got = cpu_layer_ops.add_rms_norm(x, delta, weight, 1e-6, unit_offset=True)
    assert torch.equal(x, summed)
    tolerance = 4e-6 if dtype == torch.float32 else 1e-2  # the sum of squares in another order
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(cpu_layer_ops.rms_norm(summed, weight, 1e-6, unit_offset=True), want,
                               rtol=tolerance, atol=tolerance)


def test_rms_norm_of_a_strided_view():
    fused = torch.randn(5, 3 * 64)
    x = fused[:, 64:128]  # rows contiguous, not the tensor
    torch.testing.assert_close(cpu_layer_ops.rms_norm(x, torch.ones(64), 1e-6), torch_rms_norm(x, torch.ones(64), 1e-6),
                               rtol=4e-6, atol=4e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_size", [(1, 9, 64), (37, 3, 64), (5, 8, 128), (300, 2, 32)])
def test_rotary_is_exact(dtype, tokens, heads, head_size):
    """Every product and sum rounds where the PyTorch spelling rounds: bit for bit equal."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_size // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want = torch_rotary(x, cos, sin)
    got = cpu_layer_ops.rotary(x.clone(), cos, sin)
    assert torch.equal(got, want)


def test_rotary_in_place_on_views_of_a_fused_projection():
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64)
    before = qkv.clone()
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(6, 9, 64), k.view(6, 3, 64)
    angles = torch.rand(6, 32)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q, want_k = torch_rotary(q.clone(), cos, sin), torch_rotary(k.clone(), cos, sin)
    assert cpu_layer_ops.rotary(q, cos, sin).data_ptr() == q.data_ptr()
    cpu_layer_ops.rotary(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, before[:, 12 * 64:])  # untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalises(dtype):
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(2, 33, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    stream = x.clone()
    got = cpu_layer_ops.add_rms_norm(stream, delta, weight, 1e-5)
    assert torch.equal(stream, x + delta)  # the residual add rounds as torch's does
    assert torch.equal(got, cpu_layer_ops.rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1536), (64, 1536), (5, 37)])
def test_silu_mul(dtype, rows, cols):
    gen = torch.Generator().manual_seed(rows + cols)
    gate = (torch.randn(rows, cols, generator=gen) * 6).to(dtype)
    gate[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp saturates: SiLU's limits 0 and x
    up = torch.randn(rows, cols, generator=gen).to(dtype)
    want = F.silu(gate) * up
    got = cpu_layer_ops.silu_mul_(gate, up)
    assert got.data_ptr() == gate.data_ptr()
    # Our exp is not torch's: float32 values a unit or two in the last place apart; bfloat16 rounds both to
    # the same value but at a rounding boundary.
    tolerance = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert got[0, 0] == 0 and got[0, 1] == (torch.tensor(200.0).to(dtype) * up[0, 1])


def test_silu_mul_on_halves_of_a_fused_projection():
    fused = torch.randn(4, 2 * 96)
    gate, up = fused[:, :96], fused[:, 96:]
    want = F.silu(gate) * up
    torch.testing.assert_close(cpu_layer_ops.silu_mul_(gate, up), want, rtol=2e-6, atol=2e-6)
