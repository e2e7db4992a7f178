"""What the proxy and the encoder must agree on about an image in a prompt.

- Its identity, `mm_hash`: computed by the proxy, used by the encoder as its cache key and by prefill
  and decode as an extra key of the prefix-cache block hashes.
- Its size in the prompt: the chat template writes one image token per image; the proxy expands it into
  as many tokens as the encoder returns embedding rows, and records where they are
  (`MultiModalPlaceholder`), so prefill knows which positions take which embeddings. LLaVA's images all
  take the same number; Qwen2.5-VL's as many as their size gives (dynamic resolution).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from epdserve.shared.processing.image_processor import DEFAULT_MAX_IMAGE_PIXELS, ImageProcessor, ImageProcessorConfig
from epdserve.shared.processing.qwen_image_processor import (QWEN_PROCESSORS, QwenImageProcessor,
                                                            QwenImageProcessorConfig)
from epdserve.shared.processing.qwen_vision_config import is_qwen2_5_vl
from epdserve.shared.processing.vision_config import LlavaEncoderConfig

_HASH_DOMAIN = b"epdserve-image-v1"


@dataclass(frozen=True, slots=True)
class MultiModalPlaceholder:
    """`length` prompt positions from `offset` on are filled by the embeddings of item `mm_hash`."""

    offset: int
    length: int
    mm_hash: str


def mm_hash(rgb: np.ndarray, processor: ImageProcessorConfig | QwenImageProcessorConfig) -> str:
    """Content hash of an image as the model sees it: sha256 (hex) over its decoded RGB pixels
    [height, width, 3] uint8, its size and the processor settings that turn it into a pixel tensor.

    Equal pixels hash equal whatever file format carried them; a change of any pixel or setting
    changes the hash.
    """
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError("mm_hash takes RGB pixels as a uint8 array of shape [height, width, 3]")
    h = hashlib.sha256(_HASH_DOMAIN)
    for part in (processor.canonical_json().encode(), b"%dx%d" % rgb.shape[:2]):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ImagePromptSpec:
    """How images appear in a model's prompts: the image token and how many of it one image becomes (None:
    as many as its size gives, the image processor's `num_tokens`)."""

    image_token_id: int
    num_image_tokens: int | None

    def __post_init__(self):
        if self.num_image_tokens is not None and self.num_image_tokens <= 0:
            raise ValueError(f"num_image_tokens must be positive, got {self.num_image_tokens}")

    @staticmethod
    def from_pretrained(path: str | Path) -> ImagePromptSpec:
        """Read from a LLaVA or Qwen2.5-VL checkpoint's config.json (no weights are loaded)."""
        config_file = Path(path) / "config.json"
        if config_file.is_file() and is_qwen2_5_vl(raw := json.loads(config_file.read_text())):
            return ImagePromptSpec(int(raw.get("image_token_id", 151655)), None)
        config = LlavaEncoderConfig.from_pretrained(path)
        return ImagePromptSpec(config.image_token_id, config.num_image_tokens)


def load_image_processor(path: str | Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageProcessor:
    """The image processor a model folder's preprocessor_config.json (or the image processor inside its
    processor_config.json) names: Qwen2-VL's, or CLIP's."""
    folder = Path(path)
    single, combined = folder / "preprocessor_config.json", folder / "processor_config.json"
    raw = json.loads(single.read_text()) if single.is_file() else {}
    if not raw and combined.is_file():
        raw = json.loads(combined.read_text()).get("image_processor") or {}
    if isinstance(raw, dict) and raw.get("image_processor_type") in QWEN_PROCESSORS:
        return QwenImageProcessor(QwenImageProcessorConfig.from_dict(raw), max_image_pixels)
    return ImageProcessor.from_pretrained(folder, max_image_pixels)


class ExpandedPrompt(NamedTuple):
    token_ids: list[int]
    mm_placeholders: tuple[MultiModalPlaceholder, ...]


def expand_image_tokens(token_ids: Sequence[int], spec: ImagePromptSpec, mm_hashes: Sequence[str],
                        num_tokens: Sequence[int] | None = None) -> ExpandedPrompt:
    """Replace the i-th image token of `token_ids` by `spec.num_image_tokens` copies of it (or, for a spec
    without a fixed number, `num_tokens[i]`), whose embeddings will be those of image `mm_hashes[i]`; return
    the new token ids and one placeholder per image.

    Raises ValueError when the prompt's image tokens and the images given differ in number.
    """
    positions = [i for i, t in enumerate(token_ids) if t == spec.image_token_id]
    if len(positions) != len(mm_hashes):
        raise ValueError(f"the prompt has {len(positions)} image placeholders but {len(mm_hashes)} images were given")
    if spec.num_image_tokens is not None:
        num_tokens = [spec.num_image_tokens] * len(mm_hashes)
    elif num_tokens is None or len(num_tokens) != len(mm_hashes) or any(n <= 0 for n in num_tokens):
        raise ValueError("this model's images take a number of tokens each: give a positive one per image")
    out: list[int] = []
    placeholders = []
    start = 0
    for position, item_hash, length in zip(positions, mm_hashes, num_tokens):
        out.extend(token_ids[start:position])
        placeholders.append(MultiModalPlaceholder(len(out), length, item_hash))
        out.extend([spec.image_token_id] * length)
        start = position + 1
    out.extend(token_ids[start:])
    return ExpandedPrompt(out, tuple(placeholders))
