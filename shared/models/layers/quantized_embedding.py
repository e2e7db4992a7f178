"""A token embedding kept as its quantized checkpoint ships it: a lookup dequantizes just the rows it reads,
to the float32 values the dequantized checkpoint holds (a quarter of the memory or less: SmolLM2's Q8_0
embedding is 31 MB instead of 113). A tied embedding reads its rows from the lm_head's packed panels, so the
weight is held once."""
from __future__ import annotations

import torch
from torch import nn

from epdserve.kernels import cpu_linear
from epdserve.shared.models.quantized_weight import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight | cpu_linear.QuantizedPanels, hidden_size: int) -> None:
        """`weight`: the embedding's own, or the panels the tied lm_head runs on (the weight then held once)."""
        super().__init__()
        self.hidden_size = hidden_size
        self.panels = weight if isinstance(weight, cpu_linear.QuantizedPanels) else None
        for name in ("q", "scale", "offset"):
            self.register_buffer(name, None if self.panels is not None else getattr(weight, name), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.panels is not None:
            rows = QuantizedWeight(*cpu_linear.quantized_rows(self.panels, ids, self.hidden_size))
        else:
            rows = QuantizedWeight(self.q[ids], self.scale[ids], None if self.offset is None else self.offset[ids])
        return rows.dequantize().view(*input_ids.shape, self.hidden_size)
