"""What the proxy and the encoder must agree on about an image in a prompt.

- Its identity, `mm_hash`: computed by the proxy, used by the encoder as its cache key and by prefill
  and decode as an extra key of the prefix-cache block hashes.
- Its size in the prompt: the chat template writes one image token per image; the proxy expands it into
  as many tokens as the encoder returns embedding rows, and records where they are
  (`MultiModalPlaceholder`), so prefill knows which positions take which embeddings.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from epdserve.shared.processing.image_processor import ImageProcessorConfig

_HASH_DOMAIN = b"epdserve-image-v1"


@dataclass(frozen=True, slots=True)
class MultiModalPlaceholder:
    """`length` prompt positions from `offset` on are filled by the embeddings of item `mm_hash`."""

    offset: int
    length: int
    mm_hash: str


def mm_hash(rgb: np.ndarray, processor: ImageProcessorConfig) -> str:
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
    """How images appear in a model's prompts: the image token and how many of it one image becomes."""

    image_token_id: int
    num_image_tokens: int

    def __post_init__(self):
        if self.num_image_tokens <= 0:
            raise ValueError(f"num_image_tokens must be positive, got {self.num_image_tokens}")

    @staticmethod
    def from_pretrained(path: str | Path) -> ImagePromptSpec:
        """Read from a LLaVA checkpoint's config.json (no weights are loaded)."""
        from epdserve.shared.models.vision_config import LlavaEncoderConfig

        config = LlavaEncoderConfig.from_pretrained(path)
        return ImagePromptSpec(config.image_token_id, config.num_image_tokens)


class ExpandedPrompt(NamedTuple):
    token_ids: list[int]
    mm_placeholders: tuple[MultiModalPlaceholder, ...]


def expand_image_tokens(token_ids: Sequence[int], spec: ImagePromptSpec, mm_hashes: Sequence[str]) -> ExpandedPrompt:
    """Replace the i-th image token of `token_ids` by `spec.num_image_tokens` copies of it, whose embeddings
    will be those of image `mm_hashes[i]`; return the new token ids and one placeholder per image.

    Raises ValueError when the prompt's image tokens and the images given differ in number.
    """
    positions = [i for i, t in enumerate(token_ids) if t == spec.image_token_id]
    if len(positions) != len(mm_hashes):
        raise ValueError(f"the prompt has {len(positions)} image placeholders but {len(mm_hashes)} images were given")
    out: list[int] = []
    placeholders = []
    start = 0
    for position, item_hash in zip(positions, mm_hashes):
        out.extend(token_ids[start:position])
        placeholders.append(MultiModalPlaceholder(len(out), spec.num_image_tokens, item_hash))
        out.extend([spec.image_token_id] * spec.num_image_tokens)
        start = position + 1
    out.extend(token_ids[start:])
    return ExpandedPrompt(out, tuple(placeholders))
