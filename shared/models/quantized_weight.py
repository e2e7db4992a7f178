"""A linear layer's weight as a quantized checkpoint ships it: w = scale * q (+ offset) per group of
consecutive input features (gguf_quants), kept in that form so the CPU kernel reads a byte a weight instead
of four, and unpacks the very float32 values the dequantized checkpoint holds."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // group] float32
    offset: torch.Tensor | None  # as scale; None: w = scale * q

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: scale * q, then + offset, each rounded on its own (as the reference dequantizer)."""
        n, k = self.q.shape
        w = self.q.view(n, -1, self.group).float() * self.scale[:, :, None]
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.view(n, k)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on `device`."""
        return QuantizedWeight(self.q.to(device), self.scale.to(device),
                               None if self.offset is None else self.offset.to(device))

    def in_groups_of(self, group: int, with_offset: bool) -> QuantizedWeight:
        """The same values in groups of `group` (a divisor of this one's), with an offset where asked: a
        format without one gets -0.0, the one value whose addition changes no float (x + -0.0 == x, signed
        zeros included)."""
        repeat = self.group // group
        scale = self.scale.repeat_interleave(repeat, dim=1)
        offset = self.offset
        if offset is not None:
            offset = offset.repeat_interleave(repeat, dim=1)
        elif with_offset:
            offset = torch.full_like(scale, -0.0)
        return QuantizedWeight(self.q, scale, offset)

    @classmethod
    def int8_per_channel(cls, weight: torch.Tensor) -> QuantizedWeight:
        """`weight` [N, K] quantized symmetrically, one scale per output channel: scale = max |w| / 127 over
        the row, q = round(w / scale) (a row of zeros: scale 0, q 0). What `--quantization int8` makes of a
        float checkpoint's linear layers at load; the model then computes with exactly `dequantize()`."""
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, None)

    def with_zero_rows(self, n: int) -> QuantizedWeight:
        """`n` more rows of zeros (q, scale and offset 0: each dequantizes to +0.0)."""
        def grown(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(n, t.shape[1])])

        return QuantizedWeight(grown(self.q), grown(self.scale), grown(self.offset))

    @staticmethod
    def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts one under another (a fused projection: q, k and v): in the finest group of the parts,
        with offsets if any part has them."""
        group = math.gcd(*(p.group for p in parts))
        with_offset = any(p.offset is not None for p in parts)
        parts = [p.in_groups_of(group, with_offset) for p in parts]
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               torch.cat([p.offset for p in parts]) if with_offset else None)
