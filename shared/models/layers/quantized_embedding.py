"""A token embedding kept as its quantized checkpoint ships it: a lookup dequantizes just the rows it reads,
to the float32 values the dequantized checkpoint holds (a quarter of the memory or less: SmolLM2's Q8_0
embedding is 31 MB instead of 113). A tied embedding reads its rows from the lm_head's packed panels, so the
weight is held once (the C++ kernel's panels or the Triton kernel's tiles)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from epdserve.kernels import cpu_linear
from epdserve.shared.models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from epdserve.kernels.quantized_linear import QuantizedTiles


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight | cpu_linear.QuantizedPanels | QuantizedTiles,
                 hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        """`weight`: the embedding's own, or what the tied lm_head runs on (the weight then held once); `dtype`:
        the model's, which the dequantized rows are cast to (as a dequantized checkpoint of it holds them)."""
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype
        self.packed = None if isinstance(weight, QuantizedWeight) else weight
        for name in ("q", "scale", "offset"):
            self.register_buffer(name, None if self.packed is not None else getattr(weight, name), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if isinstance(self.packed, cpu_linear.QuantizedPanels):
            rows = cpu_linear.dequantized_rows(self.packed, ids, self.hidden_size)
            return rows.to(self.dtype).view(*input_ids.shape, self.hidden_size)
        if self.packed is not None:
            from epdserve.kernels import quantized_linear  # Triton, imported only where it runs

            rows = QuantizedWeight(*quantized_linear.quantized_rows(self.packed, ids))
        else:
            rows = QuantizedWeight(self.q[ids], self.scale[ids], None if self.offset is None else self.offset[ids])
        return rows.dequantize().to(self.dtype).view(*input_ids.shape, self.hidden_size)
