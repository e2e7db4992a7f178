import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF Llama/Qwen2 do; given the
    residual stream and what a sublayer adds to it, adds it in place first (one pass instead of two)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if delta is None:
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps)
        return cpu_layer_ops.add_rms_norm(x, delta, self.weight, self.eps)
