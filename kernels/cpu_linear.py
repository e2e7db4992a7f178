"""Linear layers on CPU from weights packed into panels (csrc/cpu_linear.cpp), float32 and bfloat16.

At decode sizes a step streams every weight from memory; oneDNN's packed matmul reads it at about half
the machine's bandwidth for 1-16 rows, this kernel at 1.3-1.5x that (SmolLM2 float32, a batch-64 decode
step's linear layers: 92 -> 84 ms; a batch-1 step: 26 -> 16 ms), and as fast on prefill-sized batches.
It is batch-invariant by construction: each output is one chain of fused multiply-adds over K, in order.
Built on first use for the CPU it runs on (see cpu_build); `supports(dtype)` is False where it cannot be
built or the CPU lacks the instructions (AVX-512, or AVX2 with FMA, for float32 and quantized weights, with
the same bits on both; AVX-512 BF16 for bfloat16), and Linear keeps oneDNN.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from epdserve.kernels import cpu_build


PANEL = 64  # a panel's output columns (csrc/cpu_linear.cpp)


def _ops():
    return cpu_build.load("cpu_linear")


@functools.cache
def _dtypes() -> frozenset[torch.dtype]:
    ops = _ops()
    return frozenset(getattr(torch, name) for name in ops.dtypes()) if ops is not None else frozenset()


def supports(dtype: torch.dtype) -> bool:
    return dtype in _dtypes()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 or bfloat16 -> the kernel's panels."""
    return _ops().pack(weight.detach())


def _apply(kernel, x: torch.Tensor, panels: torch.Tensor, out_features: int, *args) -> torch.Tensor:
    """kernel(x as [rows, K] with contiguous rows, panels, out_features, *args), shaped [..., out_features]. The
    model's activations are such rows already: they go straight in (a linear layer is called ~150 times a decode
    step, and reshaping costs microseconds each time)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return kernel(x, panels, out_features, *args)
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return kernel(rows, panels, out_features, *args).view(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., out_features]."""
    return _apply(_ops().linear, x, panels, out_features, bias)


class QuantizedPanels(NamedTuple):
    """A quantized weight as the kernel reads it."""

    panels: torch.Tensor
    has_offset: bool
    zero: int  # q as nibbles, each q + zero; -1: a byte per weight


def nibble_zero(q: torch.Tensor, group: int) -> int:
    """The zero point that fits every q in a nibble (8 for signed 4-bit values, 0 for unsigned ones), or -1."""
    if group % 2 or q.numel() == 0:
        return -1
    low, high = int(q.min()), int(q.max())
    return 0 if 0 <= low and high <= 15 else 8 if -8 <= low and high <= 7 else -1


def unpacks_exactly(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> bool:
    """Whether the kernel's one fused multiply-add, q * scale + offset, rounds every weight as scale * q then
    + offset does: each product exact in float32 (a scale whose significand ends in as many zero bits as |q|
    has bits: GGUF's scales, a float16 or one times a 6-bit integer, against 4- to 6-bit q), or its offset zero."""
    if offset is None or q.numel() == 0:
        return True
    bits = max(abs(int(q.min())), abs(int(q.max()))).bit_length()
    exact = (scale.view(torch.int32) & ((1 << bits) - 1)) == 0
    return bool((exact | (offset == 0)).all())


def pack_quantized(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> QuantizedPanels:
    """A quantized [N, K] weight, w = scale * q (+ offset) per group of K // scale.shape[1] consecutive k (q int8,
    scale and offset [N, groups] float32, `unpacks_exactly`) -> the quantized kernel's panels (float32 x only);
    4-bit values (Q4_0, Q4_1, Q4_K) packed two to a byte."""
    if not unpacks_exactly(q, scale, offset):
        raise ValueError("a scale * q of this weight is not exact in float32: the kernel's fused unpacking would "
                         "round it otherwise than the dequantized weight")
    zero = nibble_zero(q, q.shape[1] // scale.shape[1])
    return QuantizedPanels(_ops().pack_quantized(q, scale, offset, zero), offset is not None, zero)


def dequantized_rows(packed: QuantizedPanels, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `rows` [T] of the weight `packed` holds, dequantized: [T, K] float32, the values the dequantized
    weight has. A tied embedding looks its tokens up here instead of keeping the weight a second time (Gemma 3's
    262k-row vocabulary: 180 MB)."""
    return _ops().dequantized_rows(packed.panels, rows.long(), in_features, packed.has_offset, packed.zero)


def linear_quantized(x: torch.Tensor, packed: QuantizedPanels, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> [..., out_features], bit for bit `linear` on the dequantized weight."""
    return _apply(_ops().linear_quantized, x, packed.panels, out_features, packed.has_offset, packed.zero, bias)
