"""The int8 KV cache's rows (--kv-cache-dtype int8): one token's values of one head quantized to int8 with
their own scale, the scale's float16 bytes after them - head_size + 2 bytes, the pool's last dimension.

A scale per row, not per block: a row's bytes depend on that row alone, so every path that writes a token
(a whole prompt, a chunk of it, a recompute on another engine) stores the same bytes, and a block moves
between engines, tiers and the store with its scales inside it. A float16 scale costs 2 bytes per 64
values (an int8 pool holds 3.9x float32's blocks, 1.94x bfloat16's), and q * scale - 7 bits times 11 - is
exact in float32: a row reads back as exactly the values it stands for, with no rounding of its own.
These are the reference the C++ and Triton kernels are tested against, and the "torch" backend's own path.
"""
from __future__ import annotations

import torch

# The bytes of an int8 row's scale (a float16), after its values.
SCALE_BYTES = 2
# The largest scale a float16 holds (a row whose largest magnitude is past 127 x this saturates).
_MAX_SCALE = 65504.0


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_size] float rows as int8 rows [..., head_size + 2]: each row's scale is its largest magnitude
    / 127 as a float16 (0 for an all-zero row), its values divided by that scale, rounded half to even and
    clamped to [-127, 127]; then the scale's bytes."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_(max=_MAX_SCALE).half()
    s = scale.float()
    q = torch.where(s > 0, torch.round(x / s), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """quantize_rows' int8 rows [..., head_size + 2] as float32 [..., head_size]: q * scale (exact)."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)
    return values.float() * scale.float()


def row_size(head_size: int, cache_dtype: torch.dtype) -> int:
    """The elements of one row of a cache of `cache_dtype`: head_size, and an int8 row's scale bytes."""
    return head_size + SCALE_BYTES if cache_dtype == torch.int8 else head_size


def head_size_of(cache: torch.Tensor) -> int:
    """The values in one row of a cache, whatever it stores."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def widened(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as float32, whatever the cache stores."""
    return dequantize_rows(rows) if rows.dtype == torch.int8 else rows.float()
