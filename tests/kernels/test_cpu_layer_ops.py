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


def weights64(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.double() / temperature
    return torch.where(torch.isneginf(x), 0.0, torch.exp(x - x.max()))


@pytest.mark.parametrize("vocab", [1, 37, 256, 1000, 49152])
def test_sampling_by_temperature_splits_the_unit_interval_by_weight(vocab):
    """u in the middle of token j's share of [0, 1) draws j, for every token with a share worth telling apart (the
    op's float32 weights and sums are a few units in the last place from float64's)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(1, vocab, generator=gen) * 2
    logits[0, :: 7] = float("-inf")  # masked tokens: no share
    logits[0, 0] = 0.5
    w = weights64(logits[0], 0.7)
    cdf = w.cumsum(0) / w.sum()
    before = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
    wide = ((cdf - before) > 1e-5).nonzero().flatten()[:300]
    u = (before[wide] + cdf[wide]) / 2
    got = cpu_layer_ops.sample_by_temperature(logits.expand(len(u), vocab), torch.full((len(u),), 0.7), u)
    assert got.tolist() == wide.tolist()


def test_sampling_by_temperature_draws_in_proportion_to_the_weights():
    """Evenly spaced uniforms draw each token as many times as its share of them, to within one."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = cpu_layer_ops.sample_by_temperature(logits.expand(n, 50).contiguous(), torch.full((n,), 1.3), u)
    counts = torch.bincount(tokens, minlength=50).double()
    w = weights64(logits[0], 1.3)
    assert (counts - n * w / w.sum()).abs().max() <= 1.01


def test_sampling_by_temperature_never_draws_a_masked_token_nor_fails_on_a_broken_row():
    vocab = 3000
    logits = torch.full((6, vocab), float("-inf"))
    allowed = [5, 256, 2999]
    logits[:, allowed] = torch.tensor([1.0, -80.0, 3.0])  # one of them all but impossible
    logits[3] = float("nan")  # a broken model's row
    logits[4, 17] = float("inf")  # +inf takes all of the mass
    logits[5, :] = torch.linspace(-500, 0, vocab)  # far below the largest: tiny weights, still drawable
    u = torch.tensor([0.0, 1 - 2**-53, 0.5, 0.5, 0.3, 0.999999], dtype=torch.float64)
    got = cpu_layer_ops.sample_by_temperature(logits, torch.ones(6), u).tolist()
    assert got[0] in allowed and got[1] in allowed and got[2] in allowed
    assert 0 <= got[3] < vocab and got[4] == 17 and 0 <= got[5] < vocab


@pytest.mark.parametrize("rows, vocab", [(16, 49152), (4, 262144)])
def test_sampling_by_temperature_samples_each_row_alone(rows, vocab):
    """A row's token is the same alone and in a batch: rows on threads of their own, or one row's blocks shared
    among the threads (a large vocabulary alone)."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.rand(rows, generator=gen) + 0.2
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    batch = cpu_layer_ops.sample_by_temperature(logits, temperature, u)
    alone = [int(cpu_layer_ops.sample_by_temperature(logits[i:i + 1], temperature[i:i + 1], u[i:i + 1]))
             for i in range(rows)]
    assert batch.tolist() == alone
