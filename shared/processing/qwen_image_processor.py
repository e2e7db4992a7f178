"""Image bytes -> patches, as Qwen2-VL's image processor (used by Qwen2.5-VL) prepares them.

Decoding and its limits are `ImageProcessor`'s (image_processor.py). The pixel math is HF transformers'
PIL-backed `Qwen2VLImageProcessor` itself: the image is resized, keeping its aspect ratio, to sides that are
multiples of `patch_size * merge_size` pixels with a pixel count between `min_pixels` and `max_pixels`
("dynamic resolution"), normalized, and cut into flattened patches, each `merge_size` x `merge_size`
block of patches consecutive. So an image's number of tokens follows from its size alone: `grid` computes
it without pixels or torch (the proxy expands an image's placeholder with it before any encoder runs), with
HF's `smart_resize` arithmetic.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from epdserve.shared.processing.image_processor import DEFAULT_MAX_IMAGE_PIXELS, ImageProcessor, three_floats

if TYPE_CHECKING:
    import torch

QWEN_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses longer strips


@dataclass(frozen=True, slots=True)
class QwenImageProcessorConfig:
    """The settings of a Qwen2-VL `preprocessor_config.json` that change pixels or tokens; all enter `mm_hash`."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # PIL bicubic
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = _OPENAI_CLIP_STD
    do_resize: bool = True  # always: the patches need sides that are multiples of the factor

    def __post_init__(self):
        if min(self.min_pixels, self.max_pixels, self.patch_size, self.temporal_patch_size, self.merge_size) <= 0:
            raise ValueError("min_pixels, max_pixels, patch_size, temporal_patch_size and merge_size must be positive")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if self.resample not in {f.value for f in Image.Resampling}:
            raise ValueError(f"unknown PIL resample filter {self.resample}")
        if not self.do_resize:
            raise ValueError("a Qwen2-VL image processor must resize (do_resize false is not supported)")

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> QwenImageProcessorConfig:
        kind = raw.get("image_processor_type")
        if kind not in QWEN_PROCESSORS:
            raise ValueError(f"unsupported image processor {kind!r}; supported: {list(QWEN_PROCESSORS)}")
        size = raw.get("size") or {}
        defaults = QwenImageProcessorConfig()
        return QwenImageProcessorConfig(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
            patch_size=int(raw.get("patch_size", 14)), temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size", 2)), resample=int(raw.get("resample", 3)),
            do_rescale=bool(raw.get("do_rescale", True)), rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=three_floats(raw.get("image_mean", _OPENAI_CLIP_MEAN), "image_mean"),
            image_std=three_floats(raw.get("image_std", _OPENAI_CLIP_STD), "image_std"),
            do_resize=bool(raw.get("do_resize", True)))

    def hf_kwargs(self) -> dict[str, Any]:
        """These settings as keyword arguments of HF's `Qwen2VLImageProcessor`."""
        return dict(size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                    patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                    merge_size=self.merge_size, resample=self.resample, do_rescale=self.do_rescale,
                    rescale_factor=self.rescale_factor, do_normalize=self.do_normalize,
                    image_mean=list(self.image_mean), image_std=list(self.image_std), do_convert_rgb=True,
                    do_resize=True)

    def canonical_json(self) -> str:
        return json.dumps({"kind": "qwen2_vl", **asdict(self)}, sort_keys=True, separators=(",", ":"))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: HF's `smart_resize`, in the same arithmetic."""
        if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
            raise ValueError(f"the image's aspect ratio must be at most {_MAX_ASPECT_RATIO}, got "
                             f"{max(height, width) / min(height, width):g}")
        factor = self.patch_size * self.merge_size
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) of an image's patches: one frame, rows and columns of patch_size pixels."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """The embeddings (prompt tokens) of an image: one per merge_size x merge_size block of patches."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size ** 2


class QwenImageProcessor(ImageProcessor):
    """Decodes untrusted image bytes and turns RGB images into Qwen2-VL patches and their grid."""

    def __init__(self, config: QwenImageProcessorConfig, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        super().__init__(config, max_image_pixels)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return self.config.resized_size(height, width)

    def preprocess_patches(self, rgb: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """RGB pixels [height, width, 3] uint8 -> (patches [t * h * w, patch_dim] float32, grid (t, h, w))."""
        if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError("preprocess takes RGB pixels as a uint8 array of shape [height, width, 3]")
        self.check_size(rgb.shape[0], rgb.shape[1])
        out = self._hf_processor()(images=Image.fromarray(rgb), return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        if grid != self.config.grid(rgb.shape[0], rgb.shape[1]):  # our token count must be HF's
            raise AssertionError(f"HF's grid {grid} differs from the computed {self.config.grid(*rgb.shape[:2])}")
        return out["pixel_values"].float(), grid

    def preprocess(self, rgb: np.ndarray):
        raise TypeError("a Qwen2-VL image becomes patches and a grid: use preprocess_patches")

    def _hf_processor(self):
        if self._hf is None:
            try:  # transformers >= 5 names the PIL-backed processor apart from the torchvision one
                from transformers import Qwen2VLImageProcessorPil as processor
            except ImportError:  # transformers 4: the plain class is the PIL one
                from transformers import Qwen2VLImageProcessor as processor
            self._hf = processor(**self.config.hf_kwargs())
        return self._hf
