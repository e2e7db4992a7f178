"""Image bytes -> pixel tensor, as a checkpoint's CLIP image processor prepares them.

The steps and their numerics follow HF transformers' PIL-backed `CLIPImageProcessor` (the "slow" one):
decode, convert to RGB (transparency composited onto white), resize the shortest side with PIL's
filter, center-crop (zero-padding an image smaller than the crop), rescale in float64 then round to
float32, normalize in float32. The result is bit-identical to that processor's `pixel_values`.
Torchvision-backed ("fast") processors resize with a different filter implementation and are not
what this reproduces.

Decoding is the trust boundary of the image path: only a few common formats are opened, and an
image's pixel count is checked from its header before any pixel is decoded.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

# Formats a client may send. Others (EPS, PSD, TIFF, ...) bring more parser surface than they are worth.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_IMAGE_PIXELS = 32 * 1024 * 1024
# Processor classes whose semantics are those above; their torchvision and PIL variants share settings.
_CLIP_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
# HF's defaults for a CLIPImageProcessor whose config leaves a setting out.
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    """The settings of a `preprocessor_config.json` that change pixels; all of them enter `mm_hash`.

    Resizing is either to a shortest side (`shortest_edge`, aspect ratio kept) or to a fixed
    `resize_height` x `resize_width`. Images are converted to RGB whatever `do_convert_rgb` says: a vision
    tower takes three channels, and for RGB input the flag changes nothing.
    """

    do_resize: bool = True
    shortest_edge: int | None = 224
    resize_height: int | None = None
    resize_width: int | None = None
    resample: int = _BICUBIC  # a PIL filter number
    do_center_crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = _OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self):
        if self.do_resize and (self.shortest_edge is None) == (self.resize_height is None or self.resize_width is None):
            raise ValueError("resizing needs either shortest_edge or resize_height and resize_width")
        sizes = (self.shortest_edge, self.resize_height, self.resize_width, self.crop_height, self.crop_width)
        if any(s is not None and s <= 0 for s in sizes):
            raise ValueError(f"image sizes must be positive, got {sizes}")
        if self.resample not in {f.value for f in Image.Resampling}:
            raise ValueError(f"unknown PIL resample filter {self.resample}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or any(s == 0 for s in self.image_std):
            raise ValueError("image_mean and image_std need three values each, and std no zero")

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> ImageProcessorConfig:
        """From the JSON of an HF CLIP image processor; settings it leaves out take HF's defaults."""
        kind = raw.get("image_processor_type", "CLIPImageProcessor")
        if kind not in _CLIP_PROCESSORS:
            raise ValueError(f"unsupported image processor {kind!r}; supported: {list(_CLIP_PROCESSORS)}")
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if "shortest_edge" in size:  # it wins over height/width, as in HF
            size = {k: v for k, v in size.items() if k not in ("height", "width")}
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if "longest_edge" in size or not ("shortest_edge" in size or {"height", "width"} <= size.keys()):
            raise ValueError(f"unsupported resize size {size}: expected shortest_edge, or height and width")
        mean, std = raw.get("image_mean", _OPENAI_CLIP_MEAN), raw.get("image_std", _OPENAI_CLIP_STD)
        return ImageProcessorConfig(
            do_resize=bool(raw.get("do_resize", True)),
            shortest_edge=size.get("shortest_edge"),
            resize_height=size.get("height"),
            resize_width=size.get("width"),
            resample=int(raw.get("resample", _BICUBIC)),
            do_center_crop=bool(raw.get("do_center_crop", True)),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_three_floats(mean, "image_mean"),
            image_std=_three_floats(std, "image_std"),
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
        )

    @staticmethod
    def from_pretrained(path: str | Path) -> ImageProcessorConfig:
        """From a model folder's `preprocessor_config.json` (or the image processor inside `processor_config.json`)."""
        folder = Path(path)
        single = folder / "preprocessor_config.json"
        if single.is_file():
            return ImageProcessorConfig.from_dict(json.loads(single.read_text()))
        combined = folder / "processor_config.json"
        if combined.is_file():
            raw = json.loads(combined.read_text())
            if isinstance(raw.get("image_processor"), dict):
                return ImageProcessorConfig.from_dict(raw["image_processor"])
        raise FileNotFoundError(f"no image processor config in {str(folder)!r}: expected preprocessor_config.json")

    def canonical_json(self) -> str:
        """These settings as one stable string (sorted keys, no spaces), for hashing."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every pixel tensor, or None when it follows the input image."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.do_resize and self.shortest_edge is None:
            return self.resize_height, self.resize_width
        return None


class ImageProcessor:
    """Decodes untrusted image bytes and turns RGB images into normalized pixel tensors."""

    def __init__(self, config: ImageProcessorConfig, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        if max_image_pixels <= 0:
            raise ValueError(f"max_image_pixels must be positive, got {max_image_pixels}")
        self.config = config
        self.max_image_pixels = max_image_pixels

    @staticmethod
    def from_pretrained(path: str | Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageProcessor:
        return ImageProcessor(ImageProcessorConfig.from_pretrained(path), max_image_pixels)

    def load(self, data: bytes) -> np.ndarray:
        """Decode image file bytes into RGB pixels [height, width, 3] uint8.

        Raises ValueError for anything that is not a readable PNG/JPEG/WebP/GIF/BMP of at most
        `max_image_pixels` pixels. An animated image gives its first frame. EXIF orientation is not
        applied (HF's processor does not apply it either).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
            raise ValueError("an image must be non-empty bytes")
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
        except Image.DecompressionBombError:  # past twice PIL's own limit
            raise ValueError(f"the image has more than the limit of {self.max_image_pixels} pixels") from None
        except Exception as e:  # noqa: BLE001 - any parser failure on untrusted bytes is bad input
            raise ValueError(f"cannot read the image (accepted formats: {', '.join(IMAGE_FORMATS)}): {e}") from None
        self.check_size(image.height, image.width)
        try:
            return np.asarray(to_rgb(image))
        except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
            raise ValueError(f"cannot decode the {image.format} image: {e}") from None

    def preprocess(self, rgb: np.ndarray) -> torch.Tensor:
        """RGB pixels [height, width, 3] uint8 -> pixel tensor [3, out_height, out_width] float32."""
        if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError("preprocess takes RGB pixels as a uint8 array of shape [height, width, 3]")
        self.check_size(rgb.shape[0], rgb.shape[1])
        c = self.config
        if c.do_resize:
            height, width = self.resized_size(rgb.shape[0], rgb.shape[1])
            rgb = np.asarray(Image.fromarray(rgb).resize((width, height), resample=c.resample))
        if c.do_center_crop:
            rgb = center_crop(rgb, c.crop_height, c.crop_width)
        pixels = torch.from_numpy(np.array(rgb))  # [H, W, 3] uint8, a writable copy
        # Rescale in float64 and round once to float32; normalize in float32 (HF's order and precision).
        pixels = (pixels.double() * c.rescale_factor).float() if c.do_rescale else pixels.float()
        if c.do_normalize:
            pixels = (pixels - torch.tensor(c.image_mean, dtype=torch.float32)) / torch.tensor(c.image_std,
                                                                                              dtype=torch.float32)
        return pixels.permute(2, 0, 1).contiguous()

    def __call__(self, data: bytes) -> torch.Tensor:
        """Image file bytes -> pixel tensor [3, out_height, out_width] float32."""
        return self.preprocess(self.load(data))

    def check_size(self, height: int, width: int) -> None:
        """Raise ValueError unless the image, and its resized copy, stay within `max_image_pixels`."""
        if height == 0 or width == 0:
            raise ValueError("the image has no pixels")
        if height * width > self.max_image_pixels:
            raise ValueError(f"the image has {width}x{height} pixels, more than the limit of {self.max_image_pixels}")
        if self.config.do_resize:
            # A thin strip resized to a shortest side would grow by its aspect ratio.
            new_height, new_width = self.resized_size(height, width)
            if new_height * new_width > self.max_image_pixels:
                raise ValueError(f"a {width}x{height} image would be resized to {new_width}x{new_height}, more "
                                 f"than the limit of {self.max_image_pixels} pixels: its aspect ratio is too extreme")

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize step."""
        c = self.config
        if c.shortest_edge is None:
            return c.resize_height, c.resize_width
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(c.shortest_edge * long / short)  # truncated, as HF does
        return (new_long, c.shortest_edge) if width <= height else (c.shortest_edge, new_long)


def _three_floats(value, name: str) -> tuple[float, float, float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * 3
    if len(values) != 3:
        raise ValueError(f"{name} needs one value per RGB channel, got {value!r}")
    return tuple(float(v) for v in values)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB; transparent pixels are composited onto white, as HF's processors do."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """Center crop of [H, W, C]; a side shorter than the crop is first zero-padded around its middle."""
    height, width = pixels.shape[:2]
    pad_top, pad_left = math.ceil(max(crop_height - height, 0) / 2), math.ceil(max(crop_width - width, 0) / 2)
    if pad_top or pad_left:
        padded = np.zeros((max(height, crop_height), max(width, crop_width), pixels.shape[2]), pixels.dtype)
        padded[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
        pixels = padded
    top = (height - crop_height) // 2 + pad_top
    left = (width - crop_width) // 2 + pad_left
    return pixels[top:top + crop_height, left:left + crop_width]
