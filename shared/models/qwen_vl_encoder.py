"""The encoder half of a Qwen2.5-VL checkpoint: its vision tower and patch merger (qwen_vision.py).

Reads an HF `Qwen2_5_VLForConditionalGeneration` folder; the language model is the engine's business
(`epdserve.shared.models.weights.language_model_weights` leaves the tower's tensors out for it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from epdserve.shared.models.qwen_vision import QwenVisionTransformer
from epdserve.shared.models.weights import iterate_weights
from epdserve.shared.models.unfilled import build_unfilled
from epdserve.shared.processing.qwen_vision_config import QwenVLEncoderConfig

# Where the tower lives in checkpoints saved by transformers 4 and 5.
_TOWER_PREFIXES = ("visual.", "model.visual.")


class QwenVLEncoder(nn.Module):
    """Image patches -> image embeddings in the language model's hidden space, a variable number per image."""

    def __init__(self, config: QwenVLEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = QwenVisionTransformer(config.vision)

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu") -> QwenVLEncoder:
        """Build the encoder of the Qwen2.5-VL checkpoint at `path` and load its weights."""
        config = QwenVLEncoderConfig.from_pretrained(path, dtype)
        encoder = build_unfilled(lambda: QwenVLEncoder(config), config.dtype, device)
        encoder.load_weights(iterate_weights(path, _TOWER_PREFIXES))
        return encoder.eval().requires_grad_(False)

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """patches [num_patches, patch_dim] of images with `grids` (t, h, w), in patches -> one tensor
        [t * h * w / merge**2, out_hidden_size] per image."""
        v = self.config.vision
        m = v.spatial_merge_size
        if any(len(g) != 3 or min(g) <= 0 or g[1] % m or g[2] % m for g in grids):
            raise ValueError(f"image grids must be (t, h, w) with h and w multiples of {m}, got {grids}")
        num_patches = sum(t * h * w for t, h, w in grids)
        if patches.dim() != 2 or tuple(patches.shape) != (num_patches, v.patch_dim):
            raise ValueError(f"patches must have shape [{num_patches}, {v.patch_dim}] for grids {grids}, "
                             f"got {list(patches.shape)}")
        device = self.visual.patch_embed.weight.device
        tokens = self.visual(patches.to(device), [tuple(int(x) for x in g) for g in grids])
        return list(tokens.split([t * h * w // m ** 2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the `visual.*` tensors of a Qwen2.5-VL checkpoint; the rest (the language model) is skipped."""
        tower = [(name.split("visual.", 1)[1], tensor) for name, tensor in weights if name.startswith(_TOWER_PREFIXES)]
        if not tower:
            raise ValueError("checkpoint has no visual (vision tower) weights")
        self.visual.load_weights(tower)
