"""What a vision tower and its projector are, as their checkpoint's config.json says: read by the encoder
that runs them (shared/models/llava_encoder.py), and by the proxy, which must know how many tokens an image takes in a prompt. No torch:
the proxy loads none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdserve.shared.config import dtype_name, parse_dtype, read_config_json

if TYPE_CHECKING:
    import torch

# HF activation names the towers and projectors compute (shared/models/clip.py's ACTIVATIONS).
ACTIVATION_NAMES = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "relu", "silu")


def check_activation(name: str) -> None:
    if name not in ACTIVATION_NAMES:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATION_NAMES)}")


# HF CLIPVisionConfig's defaults, for configs that leave a field out.
_CLIP_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                             layer_norm_eps=1e-5)


@dataclass(frozen=True, slots=True)
class CLIPVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        check_activation(self.hidden_act)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> CLIPVisionConfig:
        """From an HF `vision_config` dict; fields it leaves out take CLIPVisionConfig's defaults."""
        model_type = raw.get("model_type", "clip_vision_model")
        if model_type not in ("clip_vision_model", "clip"):
            raise ValueError(f"unsupported vision tower {model_type!r}; supported: clip_vision_model")
        c = {**_CLIP_VISION_DEFAULTS, **raw}
        return CLIPVisionConfig(
            hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]), num_heads=int(c["num_attention_heads"]),
            num_channels=int(c["num_channels"]), image_size=int(c["image_size"]), patch_size=int(c["patch_size"]),
            hidden_act=c["hidden_act"], layer_norm_eps=float(c["layer_norm_eps"]))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + 1  # the class token comes first


SELECT_STRATEGIES = ("default", "full")
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
    dtype_name: str

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32") -> LlavaEncoderConfig:
        return LlavaEncoderConfig.from_dict(read_config_json(path), str(path), dtype)

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
        check_activation(act)
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
            dtype_name=dtype_name(dtype),
        )

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_name)

    @property
    def num_image_tokens(self) -> int:
        """Embedding rows per image: one per patch, plus the class token under "full"."""
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def num_tower_layers(self) -> int:
        """Tower layers that must run: up to the deepest one read."""
        return max(self.feature_layers)
