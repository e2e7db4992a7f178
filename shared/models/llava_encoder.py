"""The encoder half of a LLaVA checkpoint: CLIP vision tower + multi-modal projector.

Reads an HF `LlavaForConditionalGeneration` folder. An image's embeddings are the tower's hidden states
at `vision_feature_layer` (several layers are concatenated along the hidden axis), without the class
token under the "default" select strategy or with it under "full", mapped into the language model's
embedding space by linear -> activation -> linear. The language model itself is the engine's business
(`epdserve.shared.models.weights.language_model_weights` leaves these tensors out for it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.clip import CLIPVisionTransformer, get_activation
from epdserve.shared.models.weight_loader import load_weights
from epdserve.shared.models.weights import iterate_weights
from epdserve.shared.models.unfilled import build_unfilled
from epdserve.shared.processing.vision_config import LlavaEncoderConfig

# Where the tower and the projector live in checkpoints of older and newer transformers versions.
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, out_features, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaEncoder(nn.Module):
    """Pixel tensors -> image embeddings in the language model's hidden space."""

    def __init__(self, config: LlavaEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionTransformer(config.vision, config.num_tower_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            config.vision.hidden_size * len(config.feature_layers), config.text_hidden_size,
            config.projector_hidden_act, config.projector_bias)

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu") -> LlavaEncoder:
        """Build the encoder of the LLaVA checkpoint at `path` and load its weights."""
        config = LlavaEncoderConfig.from_pretrained(path, dtype)
        encoder = build_unfilled(lambda: LlavaEncoder(config), config.dtype, device)
        encoder.load_weights(iterate_weights(path, _TOWER_PREFIXES + _PROJECTOR_PREFIXES))
        return encoder.eval().requires_grad_(False)

    @property
    def num_image_tokens(self) -> int:
        return self.config.num_image_tokens

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, 3, image_size, image_size] -> n tensors [num_image_tokens, text_hidden_size]."""
        v = self.config.vision
        expected = (v.num_channels, v.image_size, v.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values must have shape [n, {', '.join(map(str, expected))}], "
                             f"got {list(pixel_values.shape)}")
        device = self.multi_modal_projector.linear_1.weight.device
        # [n, num_positions, vision_hidden] per feature layer
        states = self.vision_tower(pixel_values.to(device), self.config.feature_layers)
        if self.config.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop the class token
        features = self.multi_modal_projector(torch.cat(states, dim=-1))  # [n, num_image_tokens, text_hidden]
        return list(features.unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the `vision_tower.*` and `multi_modal_projector.*` tensors of a LLaVA checkpoint; the rest
        (the language model) is skipped."""
        tower: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(_TOWER_PREFIXES):
                tower.append((name.split("vision_tower.", 1)[1], tensor))
            elif name.startswith(_PROJECTOR_PREFIXES):
                projector.append((name, tensor))
        load_weights(self.multi_modal_projector, projector,
                     rename=lambda name: name.split("multi_modal_projector.", 1)[1], what="projector weight")
        if not tower:
            raise ValueError("checkpoint has no vision_tower weights")
        self.vision_tower.load_weights(tower)
        for module in self.multi_modal_projector.modules():
            if isinstance(module, Linear):
                module.pack()
