"""Linear layers on a quantized weight for GPUs (Triton): w = scale * q (+ offset) per group of consecutive k, kept as
the checkpoint ships it - two 4-bit values to a byte (Q4_0, Q4_1, Q4_K) or a byte a weight (Q5_K, Q6_K, Q8_0, int8) -
so a decode step reads a half or a quarter of a float weight's bytes per weight, not four.

A program takes BLOCK_M rows of x and BLOCK_N output columns and walks K in tiles: it loads the tile's q, scales
and offsets, dequantizes them in registers into exactly the float32 values QuantizedWeight.dequantize() gives (q
times its scale rounded, then the offset added and rounded: the kernel is compiled without fused multiply-adds,
which would round once), casts them to x's dtype as a dequantized model of that dtype holds them, and multiplies
in float32 (IEEE, no TF32). So the layer computes on the very weights of the dequantized checkpoint; only the
order of the sums is the matmul's own, as it is for any float weight on a GPU. The values' layout is
shared/models/quantized_weight.py's; this package does not import it (shared.models imports the kernels).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from epdserve.kernels.cpu_linear import nibble_zero

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


class QuantizedTiles(NamedTuple):
    """A quantized weight as the kernel reads it."""

    q: torch.Tensor  # [N, K // 2] uint8, two values a byte, the even k in the low nibble; or [N, K] int8
    scale: torch.Tensor  # [N, K // group] float32
    offset: torch.Tensor | None  # as scale; None: w = scale * q
    zero: int  # each nibble holds q + zero; -1: a byte per weight

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.q.shape
        return n, width * 2 if self.zero >= 0 else width


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> QuantizedTiles:
    """A quantized [N, K] weight, w = scale * q (+ offset) per group of K // scale.shape[1] consecutive k (q int8,
    scale and offset [N, groups] float32), on its device, as the kernel reads it: 4-bit values two to a byte."""
    zero = nibble_zero(q, q.shape[1] // scale.shape[1])
    if zero >= 0:
        nibbles = (q.to(torch.int16) + zero).to(torch.uint8).view(q.shape[0], -1, 2)
        q = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    return QuantizedTiles(q.contiguous(), scale.float().contiguous(),
                          None if offset is None else offset.float().contiguous(), zero)


def quantized_rows(tiles: QuantizedTiles, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor | None]:
    """Rows `ids` [T] of the weight `tiles` holds, as pack() was given it: q [T, K] int8, scale and offset (or None)
    [T, groups]. A tied embedding looks its tokens up here instead of keeping the weight a second time."""
    q = tiles.q[ids]
    if tiles.zero >= 0:
        q = torch.stack((q & 15, q >> 4), dim=-1).to(torch.int16).sub_(tiles.zero).to(torch.int8).flatten(-2)
    return q, tiles.scale[ids], None if tiles.offset is None else tiles.offset[ids]


@triton.jit
def _quantized_linear_kernel(
    x_ptr,  # [M, K], rows contiguous
    q_ptr,  # [N, K // 2] uint8 or [N, K] int8
    scale_ptr, offset_ptr,  # [N, K // GROUP] float32
    bias_ptr,  # [N]
    y_ptr,  # [M, N]
    M, N, K, GROUP,
    stride_xm, stride_qn, stride_sn, stride_ym,
    ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_m = offs_m.to(tl.int64)
    cols_n = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        mask_w = mask_n[:, None] & mask_k[None, :]
        if ZERO >= 0:
            packed = tl.load(q_ptr + cols_n[:, None] * stride_qn + (offs_k // 2)[None, :], mask=mask_w, other=0)
            q = ((packed.to(tl.int32) >> ((offs_k % 2) * 4)[None, :]) & 15) - ZERO
        else:
            q = tl.load(q_ptr + cols_n[:, None] * stride_qn + offs_k[None, :], mask=mask_w, other=0).to(tl.int32)
        at_group = cols_n[:, None] * stride_sn + (offs_k // GROUP)[None, :]
        w = q.to(tl.float32) * tl.load(scale_ptr + at_group, mask=mask_w, other=0.0)
        if HAS_OFFSET:
            w = w + tl.load(offset_ptr + at_group, mask=mask_w, other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def linear(x: torch.Tensor, tiles: QuantizedTiles, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: `F.linear(x, w.to(x.dtype), bias)` on the dequantized weight w."""
    n, k = tiles.shape
    rows_x = x.reshape(-1, k)
    if rows_x.stride(-1) != 1:
        rows_x = rows_x.contiguous()
    m = rows_x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        group = k // tiles.scale.shape[1]
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _quantized_linear_kernel[grid](
            rows_x, tiles.q, tiles.scale, tiles.scale if tiles.offset is None else tiles.offset,
            tiles.scale if bias is None else bias, y, m, n, k, group,
            rows_x.stride(0), tiles.q.stride(0), tiles.scale.stride(0), y.stride(0),
            ZERO=tiles.zero, HAS_OFFSET=tiles.offset is not None, HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, enable_fp_fusion=False)
    return y.view(*x.shape[:-1], n)
