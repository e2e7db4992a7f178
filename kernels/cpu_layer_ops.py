"""RMSNorm (alone or after the residual add), rotary embedding and SiLU-and-multiply on CPU as one C++ op
each (csrc/cpu_layer_ops.cpp), with their PyTorch spelling where the kernel is not built or the tensors
are elsewhere.

Each replaces several small PyTorch ops per layer and step: at small batches a decode step is mostly such
dispatch overhead, at large ones each op is another pass over memory. The C++ ops round where the PyTorch
spelling does (see the source). `decoder_stack` goes one further: a model's layers in one C++ call a step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_build


def _ops():
    return cpu_build.load("cpu_layer_ops")


def available() -> bool:
    return _ops() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, in float32 then cast to x's dtype before the weight (HF Llama);
    `unit_offset` (Gemma): (1 + weight) * (x / rms(x)), all in float32, then cast (HF's Gemma3RMSNorm)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype and \
            (ops := _ops()) is not None:
        out = torch.empty(x.shape, dtype=x.dtype)
        ops.rms_norm(out, x, weight, eps, unit_offset)
        return out
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> torch.Tensor:
    """x += delta (the residual stream, in place), then rms_norm(x)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and delta.is_contiguous() and \
            delta.dtype == weight.dtype == x.dtype and (ops := _ops()) is not None:
        out = torch.empty(x.shape, dtype=x.dtype)
        ops.add_rms_norm(out, x, delta, weight, eps, unit_offset)
        return out
    return rms_norm(x.add_(delta), weight, eps, unit_offset)


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate = silu(gate) * up, in place (the gated MLP's activation); returns gate."""
    if gate.device.type == "cpu" and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(-1) == 1 and \
            up.dtype == gate.dtype and (ops := _ops()) is not None:
        ops.silu_mul_(gate, up)
        return gate
    return F.silu(gate, inplace=True).mul_(up)


def sample_by_temperature(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of logits [rows, vocab] float32 (on the CPU) from softmax(logits / temperature [rows]), by
    inverse CDF with the uniform u [rows] float64 in [0, 1) (see the source). Where `available()` only."""
    return _ops().sample_by_temperature(logits if logits.stride(-1) == 1 else logits.contiguous(), temperature, u)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x: [tokens, heads, head_size], cos/sin: [tokens, head_size].
    On CPU x is rotated in place (and returned)."""
    if x.device.type == "cpu" and x.stride(-1) == 1 and cos.stride(-1) == 1 and (ops := _ops()) is not None:
        ops.rotary_(x, cos, sin)
        return x
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def decoder_stack(eps: float, layers: list[dict]):
    """The C++ DecoderStack (csrc/cpu_layer_ops.cpp) over `layers`, each a dict of DecoderLayer's fields, its linear
    layers' dicts of PanelWeight's (panels, out_features, quantized, has_offset, zero, bias; up None where gate's
    panels hold both projections, its output's columns the gate's, then the up's); None where a kernel
    it calls is not built. Its `forward(x, cos, sin, local_cos, local_sin, slot_mapping, table, table_rows, lens)`
    runs every layer on the residual stream x (in place) and returns what the last one adds, with the seconds
    its attention calls took."""
    ops, linear, attention = _ops(), cpu_build.load("cpu_linear"), cpu_build.load("cpu_paged_attention")
    if ops is None or linear is None or attention is None:
        return None
    return ops.DecoderStack(linear.kernels, attention.kernels, eps, layers)
