"""A token embedding kept as its quantized checkpoint ships it: a lookup dequantizes just the rows it reads,
to the float32 values the dequantized checkpoint holds (a quarter of the memory or less: SmolLM2's Q8_0
embedding is 31 MB instead of 113)."""
from __future__ import annotations

import torch
from torch import nn

from epdserve.shared.models.quantized_weight import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.register_buffer("q", weight.q, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("offset", weight.offset, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = QuantizedWeight(self.q[ids], self.scale[ids], None if self.offset is None else self.offset[ids])
        return rows.dequantize().view(*input_ids.shape, self.q.shape[1])
