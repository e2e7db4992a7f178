import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF Llama/Qwen2 do."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_layer_ops.rms_norm(x, self.weight, self.eps)
