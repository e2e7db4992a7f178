"""Rotary position embedding (rotate-half form, as HF Llama/Qwen2), with Llama 3 and linear scaling, and
M-RoPE (Qwen2.5-VL): each frequency pair rotated by one of a token's three positions (temporal, height,
width), as `mrope_section` splits the pairs."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from epdserve.kernels import cpu_layer_ops


def inverse_frequencies(head_size: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype,
                 mrope_section: tuple[int, ...] | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_size, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, head_size / 2]: a row's two halves are the same angles (HF's cat((freqs, freqs))), so
        # the table keeps one and a lookup repeats it (Gemma 3's two 32k-position tables: 64 MB instead of 128).
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        # M-RoPE: which of the three positions each column of the half table is read at, [head_size / 2]
        # (HF's recomposition of cos and sin splits both halves alike).
        streams = None
        if mrope_section is not None:
            streams = torch.repeat_interleave(torch.arange(len(mrope_section)), torch.tensor(mrope_section))
        self.register_buffer("mrope_streams", streams, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [num_tokens, head_size]: looked up once, used by every layer.

        positions: [num_tokens], or with M-RoPE [3, num_tokens] (temporal, height, width); a token whose three
        positions are equal is rotated as 1-D RoPE rotates it."""
        if positions.dim() == 1:
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            # Each column of the table at its own stream's position: index[t, c] = positions[stream(c), t].
            index = positions[self.mrope_streams].T
            cos, sin = self.cos.gather(0, index), self.sin.gather(0, index)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    @staticmethod
    def apply(rope: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor):
        """The rotated query [num_tokens, num_heads, head_size] and key [num_tokens, num_kv_heads, head_size];
        on CPU they are rotated in place."""
        cos, sin = rope
        return cpu_layer_ops.rotary(query, cos, sin), cpu_layer_ops.rotary(key, cos, sin)
