"""Linear on whatever CPU runs the tests: packing never fails, and the result is F.linear's."""
import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_linear
from epdserve.shared.models.layers import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_dtype_packs_on_this_cpu_and_computes_f_linear(dtype):
    # bfloat16 on an AVX2 CPU: oneDNN's reorder raised, which failed every bfloat16 model load there.
    layer = linear.Linear(64, 48).to(dtype)
    layer.pack()
    path = "panels" if layer.panels is not None else "onednn" if layer.packed_weight is not None else "f.linear"
    expected = ("panels" if cpu_linear.supports(dtype) else "onednn" if linear.onednn_supports(dtype) else "f.linear")
    assert path == expected
    x = torch.randn(5, 64).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                               **tolerance)


def test_onednn_packs_bfloat16_only_where_the_cpu_can():
    assert linear.onednn_supports(torch.float32) == linear.onednn_available()
    assert linear.onednn_supports(torch.bfloat16) == (
        linear.onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not linear.onednn_supports(torch.float16)
