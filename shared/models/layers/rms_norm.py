import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF Llama/Qwen2 do; given the
    residual stream and what a sublayer adds to it, adds it in place first (one pass instead of two).

    `unit_offset` (Gemma): the weight is an offset from 1 (it loads as zeros for an identity scale), and the
    scaling by (1 + weight) happens in float32 before the cast, as HF's Gemma3RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if delta is None:
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return cpu_layer_ops.add_rms_norm(x, delta, self.weight, self.eps, self.unit_offset)
