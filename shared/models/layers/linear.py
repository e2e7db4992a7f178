"""A linear layer that runs oneDNN on a prepacked weight on CPU.

PyTorch's default CPU matmul (MKL) reaches ~50-90 GFLOP/s per core on this model's shapes; oneDNN with
the weight reordered once into its blocked layout reaches ~100 on the same shapes, the lm_head included.
oneDNN's rows are also batch-invariant (a token's result does not depend on what else is in the batch).
Falls back to `F.linear` where the oneDNN ops are missing or the weight is not on the CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_OPS = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_BATCH_HINT = 64  # rows the packing is tuned for; any row count works


def onednn_available() -> bool:
    return _ONEDNN_OPS and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def pack(self, weight: torch.Tensor | None = None) -> None:
        """Reorder `weight` (default: this layer's own) for oneDNN; call again after weights change."""
        weight = self.weight if weight is None else weight
        if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and onednn_available():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
