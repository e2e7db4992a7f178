"""An image's embeddings from its RGB pixels, for whichever vision family a checkpoint is: its image
processor (HF's pixel math), then its vision encoder. What the encoder service runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from epdserve.shared.models.llava_encoder import LlavaEncoder
from epdserve.shared.models.qwen_vl_encoder import QwenVLEncoder
from epdserve.shared.processing.image_processor import ImageProcessor
from epdserve.shared.processing.multimodal import load_image_processor
from epdserve.shared.processing.qwen_image_processor import QwenImageProcessor
from epdserve.shared.processing.qwen_vision_config import is_qwen2_5_vl


class ImageEncoder:
    """A checkpoint's image processor and vision encoder (LLaVA's CLIP tower and projector, or Qwen2.5-VL's
    windowed tower and patch merger)."""

    def __init__(self, processor: ImageProcessor, encoder: LlavaEncoder | QwenVLEncoder) -> None:
        if isinstance(encoder, QwenVLEncoder) != isinstance(processor, QwenImageProcessor):
            raise ValueError(f"{type(processor).__name__} does not prepare images for {type(encoder).__name__}")
        self.processor = processor
        self.encoder = encoder

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu") -> ImageEncoder:
        raw = json.loads((Path(path) / "config.json").read_text())
        cls = QwenVLEncoder if is_qwen2_5_vl(raw) else LlavaEncoder
        return ImageEncoder(load_image_processor(path), cls.from_pretrained(path, dtype, device))

    def embed(self, rgb: np.ndarray) -> torch.Tensor:
        """RGB pixels [height, width, 3] uint8 -> embeddings [num_tokens, text_hidden_size] (num_tokens fixed
        for LLaVA, from the image's size for Qwen2.5-VL); raises ValueError for an image it cannot take."""
        if isinstance(self.encoder, QwenVLEncoder):
            patches, grid = self.processor.preprocess_patches(rgb)
            return self.encoder.encode(patches, [grid])[0]
        return self.encoder.encode(self.processor.preprocess(rgb).unsqueeze(0))[0]
