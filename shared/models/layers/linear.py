"""A linear layer that runs on a prepacked weight on CPU.

PyTorch's default CPU matmul (MKL) reaches ~50-90 GFLOP/s per core on this model's shapes. Our panel
kernel (kernels/cpu_linear.py) is, in float32, as fast as oneDNN's packed matmul on large batches and faster
where a step streams its weights from memory (decodes); in bfloat16 it is built for decode-sized batches, and
on a CPU with AMX oneDNN's bfloat16 matmul is several times faster from 16 rows up, which this layer does not
use. Where the CPU lacks the panel kernel's instructions, oneDNN runs with the weight reordered once into its
blocked layout. Both keep a token's result independent of what else is in the batch. Falls back to
`F.linear` where neither applies (the weight not on the CPU). A quantized checkpoint's weight is kept as it
ships (w = scale * q (+ offset)) and run by the C++ quantized kernel on a CPU, by the Triton one on a GPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels import cpu_linear
from epdserve.shared.models.layers.lora import LoRAStack
from epdserve.shared.models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from epdserve.kernels.quantized_linear import QuantizedTiles

_ONEDNN_OPS = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_BATCH_HINT = 64  # rows the packing is tuned for; any row count works


def onednn_available() -> bool:
    return _ONEDNN_OPS and torch.backends.mkldnn.is_available()


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU: float32 always, bfloat16 only with AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT - on an AVX2 CPU its reorder raises, which failed every bfloat16 model load."""
    if not onednn_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout
    panels: torch.Tensor | None = None  # cpu_linear's
    lora: LoRAStack | None = None  # the resident LoRA adapters' weights, on a layer they may adapt
    # A weight kept as its checkpoint ships it: the C++ kernel's panels, or the Triton kernel's tiles.
    quantized: cpu_linear.QuantizedPanels | QuantizedTiles | None = None

    @staticmethod
    def runs_quantized(weight: torch.Tensor, triton: bool = False) -> bool:
        """Whether a layer with this (float) weight runs a quantized one as shipped: by the Triton kernel where
        the engine runs Triton's (`triton`: a GPU, or the interpreter in tests), by the C++ kernel in float32 on a
        CPU that has it. Elsewhere a quantized checkpoint is dequantized at load (the same values)."""
        if triton:
            return weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_linear.supports(torch.float32)

    def set_quantized(self, weight: QuantizedWeight, triton: bool = False) -> None:
        """Run on `weight` as shipped, by the kernel runs_quantized(..., triton) chose. Its float parameter is then
        never read: it gives back its memory and stays as zeros of its shape, dtype and device."""
        if triton:
            from epdserve.kernels import quantized_linear  # Triton, imported only where it runs

            weight = weight.to(self.weight.device)
            self.quantized = quantized_linear.pack(weight.q, weight.scale, weight.offset)
        else:
            self.quantized = cpu_linear.pack_quantized(weight.q, weight.scale, weight.offset)
        self.packed_weight = self.panels = None
        self.weight = nn.Parameter(torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
                                   .expand(self.weight.shape), requires_grad=False)

    @classmethod
    def over(cls, weight: torch.Tensor) -> Linear:
        """A packed Linear without bias over `weight` [out_features, in_features], its storage shared (one
        expert's slice of stacked weights)."""
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.pack()
        return layer

    def pack(self, weight: torch.Tensor | None = None) -> None:
        """Pack `weight` (default: this layer's own) for the CPU kernels; call again after weights change."""
        if self.quantized is not None:
            return
        weight = self.weight if weight is None else weight
        self.packed_weight = self.panels = None
        if weight.device.type != "cpu":
            return
        if cpu_linear.supports(weight.dtype):
            self.panels = cpu_linear.pack(weight)
        elif onednn_supports(weight.dtype):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)

    def panel_weight(self, dtype: torch.dtype) -> dict | None:
        """What the C++ decoder stack runs this layer on, for `dtype` activations (cpu_layer_ops.decoder_stack's):
        the panels `_base` would run; None where it runs anything else (oneDNN, F.linear, Triton) or LoRA."""
        if self.lora is not None:
            return None
        if isinstance(self.quantized, cpu_linear.QuantizedPanels) and dtype == torch.float32:
            return dict(panels=self.quantized.panels, out_features=self.out_features, quantized=True,
                        has_offset=self.quantized.has_offset, zero=self.quantized.zero, bias=self.bias)
        if self.quantized is None and self.panels is not None and self.panels.dtype == dtype:
            return dict(panels=self.panels, out_features=self.out_features, quantized=False, has_offset=False,
                        zero=-1, bias=self.bias)
        return None

    @staticmethod
    def joined_panel_weight(first: Linear, second: Linear, dtype: torch.dtype) -> dict | None:
        """Two layers of one shape and input as one panel weight for the C++ decoder stack, whose output's columns
        are first's, then second's (one call instead of two: the threads start and meet once, and share the panels
        of both); None where their panels differ in form or first's last panel has padding columns. Both layers
        then run on views of the joined panels, so the weights are still held once. Each output column is computed
        as before: the same values bit for bit."""
        a, b = first.panel_weight(dtype), second.panel_weight(dtype)
        if a is None or b is None or a["bias"] is not None or b["bias"] is not None or \
                first.out_features != second.out_features or first.out_features % cpu_linear.PANEL or \
                any(a[k] != b[k] for k in ("quantized", "has_offset", "zero")) or \
                a["panels"].dtype != b["panels"].dtype or a["panels"].shape[1:] != b["panels"].shape[1:]:
            return None
        panels = torch.cat([a["panels"], b["panels"]])
        for layer, part in zip((first, second), panels.split([len(a["panels"]), len(b["panels"])])):
            if a["quantized"]:
                layer.quantized = layer.quantized._replace(panels=part)
            else:
                layer.panels = part
        return dict(a, panels=panels, out_features=first.out_features + second.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, cpu_linear.QuantizedPanels):
            return cpu_linear.linear_quantized(x, self.quantized, self.out_features, self.bias)
        if self.quantized is not None:
            from epdserve.kernels import quantized_linear

            return quantized_linear.linear(x, self.quantized, self.bias)
        if self.panels is not None and x.dtype == self.panels.dtype:
            return cpu_linear.linear(x, self.panels, self.out_features, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
