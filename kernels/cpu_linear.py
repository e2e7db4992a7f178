"""Linear layers on CPU in float32 from weights packed into panels (csrc/cpu_linear.cpp).

At decode sizes a step streams every weight from memory; oneDNN's packed matmul reads it at about half
the machine's bandwidth for 1-16 rows, this kernel at 1.3-1.5x that (a SmolLM2 batch-64 decode step's
linear layers: 92 -> 84 ms; a batch-1 step: 26 -> 17 ms), and it is batch-invariant by construction. Its
rows run as one fused multiply-add chain over K, in order. Built on first use for the CPU it runs on (see
cpu_build); where it cannot be built or the CPU lacks AVX-512, `available()` is False and Linear keeps
oneDNN.
"""
from __future__ import annotations

import torch

from epdserve.kernels import cpu_build


def _ops():
    ops = cpu_build.load("cpu_linear.cpp")
    return ops if ops is not None and ops.available() else None


def available() -> bool:
    return _ops() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the kernel's panels."""
    return _ops().pack(weight.detach())


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., out_features]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return _ops().linear(rows, panels, out_features, bias).view(*x.shape[:-1], out_features)
