"""What Qwen2.5-VL's vision tower is, as its checkpoint's config.json says: read by the encoder that runs it
(shared/models/qwen_vision.py), and by the proxy, which must know whether a checkpoint is Qwen2.5-VL's. No
torch: only what runs the tower loads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdserve.shared.config import dtype_name, parse_dtype, read_config_json
from epdserve.shared.processing.vision_config import check_activation

if TYPE_CHECKING:
    import torch

QWEN2_5_VL_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# Qwen2_5_VLVisionConfig's defaults, for configs that leave a field out.
_VISION_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # pixels a side of an attention window
    out_hidden_size: int  # the language model's hidden size
    fullatt_block_indexes: tuple[int, ...]  # the blocks that attend over a whole image; the others by window
    hidden_act: str
    rope_theta: float

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.head_size % 4:
            raise ValueError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a multiple of 4")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"window_size {self.window_size} is not a multiple of patch_size x spatial_merge_size")
        check_activation(self.hidden_act)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> QwenVisionConfig:
        c = {**_VISION_DEFAULTS, **raw}
        rope = c.get("rope_parameters") or {}
        return QwenVisionConfig(
            depth=int(c["depth"]), hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
            num_heads=int(c["num_heads"]), in_channels=int(c["in_channels"]), patch_size=int(c["patch_size"]),
            temporal_patch_size=int(c["temporal_patch_size"]), spatial_merge_size=int(c["spatial_merge_size"]),
            window_size=int(c["window_size"]), out_hidden_size=int(c["out_hidden_size"]),
            fullatt_block_indexes=tuple(int(i) for i in c["fullatt_block_indexes"]), hidden_act=c["hidden_act"],
            rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal_patch_size x patch_size x patch_size."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_tokens(self) -> int:
        """Merged tokens a side of an attention window."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True, slots=True)
class QwenVLEncoderConfig:
    """What the encoder needs from a Qwen2.5-VL `config.json`."""

    path: str
    vision: QwenVisionConfig
    image_token_id: int
    dtype_name: str

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32") -> QwenVLEncoderConfig:
        raw = read_config_json(path)
        if not is_qwen2_5_vl(raw):
            raise ValueError(f"{path} is not a Qwen2.5-VL checkpoint (model_type {raw.get('model_type')!r})")
        vision = QwenVisionConfig.from_dict(raw.get("vision_config") or {})
        text_hidden = (raw.get("text_config") or raw).get("hidden_size")
        if text_hidden is not None and int(text_hidden) != vision.out_hidden_size:
            raise ValueError(f"the vision tower's out_hidden_size {vision.out_hidden_size} is not the language "
                             f"model's hidden_size {text_hidden}")
        return QwenVLEncoderConfig(str(path), vision, int(raw.get("image_token_id", 151655)), dtype_name(dtype))

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_name)


def is_qwen2_5_vl(raw: dict[str, Any]) -> bool:
    """Whether a config.json is a Qwen2.5-VL checkpoint's."""
    return raw.get("model_type") == "qwen2_5_vl" or QWEN2_5_VL_ARCHITECTURE in (raw.get("architectures") or ())
