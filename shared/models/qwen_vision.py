"""Qwen2.5-VL's vision tower: a windowed vision transformer and the patch merger.

An image arrives as its flattened patches (HF's Qwen2-VL image processor: resized to a multiple of 28
pixels a side, cut into 14-pixel patches, each 2x2 block of patches consecutive) and its grid (t, h, w) in
patches. A 3-D convolution embeds each patch; 2-D rotary embeddings carry each patch's row and column.
Most blocks attend only within windows of `window_size` pixels a side (the last row and column of windows
may be partial), some (`fullatt_block_indexes`) over the whole image; blocks run on the tokens in window
order, so a window is a contiguous run. The merger norms each patch, concatenates every 2x2 block into
one token and projects it into the language model's space; tokens return to row-major order. So an image
of h x w patches gives h * w / 4 embeddings. Numerics follow HF transformers' `Qwen2_5_VisionTransformer`
(float32 RMSNorm, float32 rotary, SDPA per window).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.shared.models.clip import get_activation
from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.layers.rms_norm import RMSNorm
from epdserve.shared.models.weight_loader import load_weights
from epdserve.shared.processing.qwen_vision_config import QwenVisionConfig

_NORM_EPS = 1e-6  # HF's, fixed for the tower and the merger


class ImageLayout(NamedTuple):
    """How a batch of images' patches are ordered for the blocks."""

    window_index: torch.Tensor  # [num_merged_tokens]: the merged token at each place in window order
    window_lengths: list[int]  # patches of each window, in order
    image_lengths: list[int]  # patches of each image, in order


def image_layout(grids: list[tuple[int, int, int]], config: QwenVisionConfig) -> ImageLayout:
    """The window order of merged tokens (row-major within each image) and the window and image lengths."""
    m, side = config.spatial_merge_size, config.window_tokens
    index, windows, images, base = [], [], [], 0
    for t, h, w in grids:
        rows, cols = h // m, w // m
        grid = torch.arange(t * rows * cols).view(t, rows, cols) + base
        for frame in grid:
            for top in range(0, rows, side):
                for left in range(0, cols, side):
                    window = frame[top:top + side, left:left + side].reshape(-1)
                    index.append(window)
                    windows.append(window.numel() * m * m)
        images.append(t * h * w)
        base += t * rows * cols
    return ImageLayout(torch.cat(index), windows, images)


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, patches in the processor's order (each merge x merge block
    consecutive): [num_patches, 2]."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows, cols = (p.reshape(shape).transpose(1, 2).flatten() for p in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_size = config.num_heads, config.head_size
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        """x [num_patches, hidden]; attention within each run of `lengths` consecutive patches."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_size).unbind(1)  # [n, heads, head_size]
        cos, sin = (r.unsqueeze(-2) for r in rope)  # rotated in float32, as HF does
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        # Runs of one length go through SDPA together, [num_runs, heads, length, head_size]: most windows are
        # whole, so a large image is a few calls, not one per window.
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths):
            by_length.setdefault(length, []).append(start)
        for length, run_starts in by_length.items():
            rows = (torch.tensor(run_starts)[:, None] + torch.arange(length)).reshape(-1)
            qs, ks, vs = (t[rows].view(len(run_starts), length, self.num_heads, self.head_size).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_size ** -0.5)
            out[rows] = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_size)
        return self.proj(out.view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.act = get_activation(config.hidden_act)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one token in the language model's space: RMSNorm, concat, Linear-GELU-Linear."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, _NORM_EPS)
        self.fc1 = Linear(self.merged_size, self.merged_size, bias=True)
        self.fc2 = Linear(self.merged_size, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.merged_size))))


class QwenVisionTransformer(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        size = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed = nn.Conv3d(config.in_channels, config.hidden_size, size, stride=size, bias=False)
        quarter = config.head_size // 2  # rows and columns each rotate half the head
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [num_patches, patch_dim] of images with `grids` (t, h, w) -> [num_patches / merge**2,
        out_hidden_size], each image's tokens row-major, images in order."""
        c, unit = self.config, self.config.spatial_merge_size ** 2
        layout = image_layout(grids, c)
        x = self.patch_embed(patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
                             .to(self.patch_embed.weight.dtype)).view(-1, c.hidden_size)
        n = x.shape[0]

        def window_order(t: torch.Tensor) -> torch.Tensor:  # [n, ...] in window order, merge blocks kept whole
            return t.reshape(n // unit, unit, -1)[layout.window_index].reshape(n, -1)

        x = window_order(x)
        freqs = patch_positions(grids, c.spatial_merge_size).to(x.device)[..., None].float() * self.inv_freq
        freqs = freqs.flatten(1)  # [n, head_size / 2]: the row's frequencies, then the column's
        emb = window_order(torch.cat((freqs, freqs), dim=-1))
        rope = (emb.cos(), emb.sin())
        for i, block in enumerate(self.blocks):
            x = block(x, rope, layout.image_lengths if i in c.fullatt_block_indexes else layout.window_lengths)
        return self.merger(x)[torch.argsort(layout.window_index.to(x.device))]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (relative to the tower: `patch_embed.proj.weight`, `blocks.N.`, `merger.`)
        into our parameters; every parameter must be written exactly once."""
        load_weights(self, weights, rename=_our_name, what="vision tower weight")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()


def _our_name(hf_name: str) -> str:
    """The name a tower tensor goes by here."""
    return (hf_name.replace("patch_embed.proj.", "patch_embed.")
            .replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2."))
