"""Image bytes -> pixel tensor, as a checkpoint's CLIP image processor prepares them.

Two halves. Decoding is the trust boundary of the image path and is ours: only a few common formats
are opened, an image's pixel count is checked from its header before any pixel is decoded, and the
result is RGB (transparency composited onto white, as HF's processors do), which `mm_hash` hashes.
The pixel math (resize, center crop, rescale, normalize) is HF transformers' PIL-backed
`CLIPImageProcessor` itself, so it is exact by definition.

`ImageProcessorConfig` is the part of `preprocessor_config.json` that changes pixels: it enters
`mm_hash`, bounds the resized size, and refuses settings the vision path does not support.
Torchvision-backed ("fast") processors resize with a different filter implementation and are not used.
"""
from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

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
            image_mean=three_floats(mean, "image_mean"),
            image_std=three_floats(std, "image_std"),
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

    def hf_kwargs(self) -> dict[str, Any]:
        """These settings as keyword arguments of HF's `CLIPImageProcessor`."""
        if self.shortest_edge is not None:
            size = {"shortest_edge": self.shortest_edge}
        else:
            size = {"height": self.resize_height, "width": self.resize_width}
        return dict(do_resize=self.do_resize, size=size, resample=self.resample, do_center_crop=self.do_center_crop,
                    crop_size={"height": self.crop_height, "width": self.crop_width}, do_rescale=self.do_rescale,
                    rescale_factor=self.rescale_factor, do_normalize=self.do_normalize,
                    image_mean=list(self.image_mean), image_std=list(self.image_std), do_convert_rgb=True)

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
        self._hf = None  # HF's processor, made by the first `preprocess`: the proxy only decodes and hashes

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
        # A PIL image, not the array: HF guesses an array's channel axis, and a 3-pixel-high image looks
        # channels-first to it.
        out = self._hf_processor()(images=Image.fromarray(rgb), return_tensors="pt")
        return out["pixel_values"][0].float()

    def _hf_processor(self):
        if self._hf is None:
            try:  # transformers >= 5 names the PIL-backed processor apart from the torchvision one
                from transformers import CLIPImageProcessorPil as processor
            except ImportError:  # transformers 4: the plain class is the PIL one
                from transformers import CLIPImageProcessor as processor
            self._hf = processor(**self.config.hf_kwargs())
        return self._hf

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


def three_floats(value, name: str) -> tuple[float, float, float]:
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

