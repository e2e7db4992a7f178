"""The encoder half of a LLaVA checkpoint: CLIP vision tower + multi-modal projector.

Reads an HF `LlavaForConditionalGeneration` folder. An image's embeddings are the tower's hidden states
at `vision_feature_layer` (several layers are concatenated along the hidden axis), without the class
token under the "default" select strategy or with it under "full", mapped into the language model's
embedding space by linear -> activation -> linear. The language model itself is the engine's business
(`epdserve.shared.models.weights.language_model_weights` leaves these tensors out for it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from epdserve.shared.config import parse_dtype
from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.clip import CLIPVisionConfig, CLIPVisionTransformer, get_activation
from epdserve.shared.models.weights import iterate_weights

SELECT_STRATEGIES = ("default", "full")
# Where the tower and the projector live in checkpoints of older and newer transformers versions.
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# LlavaConfig's tower when a config has no `vision_config` (CLIP ViT-L/14 at 336 pixels).
_LLAVA_DEFAULT_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                             image_size=336, patch_size=14)


@dataclass(frozen=True, slots=True)
class LlavaEncoderConfig:
    """What the encoder needs from a LLaVA `config.json`; fields left out take LlavaConfig's defaults."""

    path: str
    vision: CLIPVisionConfig
    # Indices into the tower's hidden states (0 = embeddings, i = after layer i), non-negative.
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    dtype: torch.dtype

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32") -> LlavaEncoderConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no model at {str(path)!r}: expected an HF folder with config.json")
        return LlavaEncoderConfig.from_dict(json.loads(config_file.read_text()), str(path), dtype)

    @staticmethod
    def from_dict(raw: dict[str, Any], path: str = "", dtype: str | torch.dtype = "float32") -> LlavaEncoderConfig:
        if raw.get("model_type") != "llava" and "LlavaForConditionalGeneration" not in (raw.get("architectures") or ()):
            raise ValueError(f"{path or 'this config'} is not a LLaVA checkpoint (model_type "
                             f"{raw.get('model_type')!r}); the image encoder needs an HF LlavaForConditionalGeneration "
                             f"folder")
        vision = CLIPVisionConfig.from_dict(raw.get("vision_config") or _LLAVA_DEFAULT_VISION)
        layers = raw.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        num_states = vision.num_layers + 1  # the embeddings, then one per layer
        if not layers or any(not -num_states <= i < num_states for i in layers):
            raise ValueError(f"vision_feature_layer {raw.get('vision_feature_layer')} is outside the tower's "
                             f"{num_states} hidden states")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: {SELECT_STRATEGIES}")
        act = raw.get("projector_hidden_act", "gelu")
        get_activation(act)
        image_token_id = raw.get("image_token_id", raw.get("image_token_index", 32000))
        return LlavaEncoderConfig(
            path=path,
            vision=vision,
            feature_layers=tuple(i % num_states for i in layers),
            select_strategy=strategy,
            projector_hidden_act=act,
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            text_hidden_size=int((raw.get("text_config") or {}).get("hidden_size", 4096)),
            image_token_id=int(image_token_id),
            dtype=parse_dtype(dtype),
        )

    @property
    def num_image_tokens(self) -> int:
        """Embedding rows per image: one per patch, plus the class token under "full"."""
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def num_tower_layers(self) -> int:
        """Tower layers that must run: up to the deepest one read."""
        return max(self.feature_layers)


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
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with torch.device(device):
                encoder = LlavaEncoder(config)
        finally:
            torch.set_default_dtype(default_dtype)
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
        projector = dict(self.multi_modal_projector.named_parameters())
        pending = set(projector)
        for name, tensor in weights:
            if name.startswith(_TOWER_PREFIXES):
                tower.append((name.split("vision_tower.", 1)[1], tensor))
            elif name.startswith(_PROJECTOR_PREFIXES):
                local = name.split("multi_modal_projector.", 1)[1]
                if local not in projector:
                    raise ValueError(f"unexpected projector weight {name!r}")
                if tensor.shape != projector[local].shape:
                    raise ValueError(f"projector weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(projector[local].shape)}")
                projector[local].data.copy_(tensor)
                pending.discard(local)
        if pending:
            raise ValueError(f"checkpoint lacks projector weights: {sorted(pending)}")
        if not tower:
            raise ValueError("checkpoint has no vision_tower weights")
        self.vision_tower.load_weights(tower)
        for module in self.multi_modal_projector.modules():
            if isinstance(module, Linear):
                module.pack()
