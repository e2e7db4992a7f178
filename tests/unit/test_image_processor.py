"""Our image processor equals HF's PIL-backed CLIPImageProcessor bit for bit, and refuses bad bytes clearly."""
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.shared.processing.image_processor import ImageProcessor, ImageProcessorConfig

try:  # transformers >= 5 names the PIL-backed processor apart from the torchvision one
    from transformers import CLIPImageProcessorPil as HFProcessor
except ImportError:  # transformers 4: the plain class is the PIL one
    from transformers import CLIPImageProcessor as HFProcessor

# Processor settings as they appear in preprocessor_config.json files.
SETTINGS = {
    "clip-224": {},
    "llava-1.5-336": {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},
    # Fixed-size resize without a crop, another filter, no normalization.
    "fixed-bilinear": {"size": {"height": 64, "width": 96}, "do_center_crop": False, "resample": 2,
                       "do_normalize": False},
    # A crop larger than the resized image: HF zero-pads before cropping.
    "crop-pads": {"size": {"shortest_edge": 50}, "crop_size": {"height": 64, "width": 80}},
    # No resize, no rescale: normalization of raw 0..255 values.
    "crop-only": {"do_resize": False, "crop_size": {"height": 32, "width": 40}, "do_rescale": False,
                  "image_mean": [127.5, 127.5, 127.5], "image_std": [64.0, 64.0, 64.0]},
}


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def hf_pixels(settings_dict: dict, data: bytes) -> torch.Tensor:
    out = HFProcessor(**settings_dict)(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    return out["pixel_values"][0]


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def palette_with_transparency() -> Image.Image:
    image = Image.fromarray(noise(70, 50, seed=3)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    image.info["transparency"] = 5
    return image


IMAGES = {
    "square-rgb": lambda: Image.fromarray(noise(224, 224)),
    "wide-rgb": lambda: Image.fromarray(noise(300, 500, seed=1)),
    "tall-odd-rgb": lambda: Image.fromarray(noise(501, 301, seed=2)),
    "tiny-rgb": lambda: Image.fromarray(noise(10, 7, seed=4)),
    "one-pixel-row": lambda: Image.fromarray(noise(1, 60, seed=11)),
    "extreme-aspect": lambda: Image.fromarray(noise(1000, 40, seed=5)),
    "rgba": lambda: Image.fromarray(noise(120, 200, 4, seed=6), mode="RGBA"),
    "grayscale": lambda: Image.fromarray(noise(150, 90, 1, seed=7), mode="L"),
    "gray-alpha": lambda: Image.fromarray(noise(90, 150, 2, seed=8), mode="LA"),
    "bilevel": lambda: Image.fromarray(noise(64, 48, 1, seed=9) > 127),
    "palette-transparent": palette_with_transparency,
}


@pytest.mark.parametrize("settings_name", SETTINGS)
@pytest.mark.parametrize("image_name", IMAGES)
def test_pixels_equal_hf_bit_for_bit(settings_name, image_name):
    settings_dict = SETTINGS[settings_name]
    data = encode(IMAGES[image_name]())
    ours = ImageProcessor(ImageProcessorConfig.from_dict(settings_dict))(data)
    expected = hf_pixels(settings_dict, data)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert torch.equal(ours, expected.float())


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP"])
def test_other_formats_equal_hf(fmt):
    image = Image.fromarray(noise(97, 131, seed=10))
    data = encode(image.convert("CMYK") if fmt == "JPEG" else image, fmt)
    assert torch.equal(ImageProcessor(ImageProcessorConfig())(data), hf_pixels({}, data))


# Sides from 4 pixels: a thinner strip resized to a 336-pixel shortest side passes the pixel limit (tested below).
@settings(max_examples=25, deadline=None)
@given(height=st.integers(4, 320), width=st.integers(4, 320), seed=st.integers(0, 2**16),
       settings_name=st.sampled_from(sorted(SETTINGS)))
def test_random_sizes_equal_hf(height, width, seed, settings_name):
    settings_dict = SETTINGS[settings_name]
    data = encode(Image.fromarray(noise(height, width, seed=seed)))
    assert torch.equal(ImageProcessor(ImageProcessorConfig.from_dict(settings_dict))(data),
                       hf_pixels(settings_dict, data))


@pytest.mark.parametrize("settings_name", SETTINGS)
def test_config_round_trips_through_hf(settings_name):
    settings_dict = SETTINGS[settings_name]
    assert ImageProcessorConfig.from_dict(HFProcessor(**settings_dict).to_dict()) == \
        ImageProcessorConfig.from_dict(settings_dict)


def test_config_from_model_folder(tmp_path):
    # transformers 5 nests the image processor in processor_config.json; older folders have their own file.
    nested = {"image_processor": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
                                  "crop_size": {"height": 336, "width": 336}}, "processor_class": "LlavaProcessor"}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert ImageProcessorConfig.from_pretrained(tmp_path).output_size == (336, 336)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"crop_size": 288, "size": 288}))
    assert ImageProcessorConfig.from_pretrained(tmp_path).output_size == (288, 288)
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("raw, message", [
    ({"image_processor_type": "SiglipImageProcessor"}, "unsupported image processor"),
    ({"size": {"shortest_edge": 224, "longest_edge": 448}}, "unsupported resize size"),
    ({"size": {"height": 224}}, "unsupported resize size"),
    ({"image_mean": [0.5, 0.5]}, "one value per RGB channel"),
    ({"image_std": [0.5, 0.0, 0.5]}, "std no zero"),
    ({"crop_size": {"height": 0, "width": 224}}, "positive"),
    ({"resample": 42}, "resample filter"),
])
def test_bad_settings_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        ImageProcessorConfig.from_dict(raw)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares a size in its header but carries no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_oversized_images_are_refused_before_decoding():
    processor = ImageProcessor(ImageProcessorConfig())
    with pytest.raises(ValueError, match="8000x5000 pixels, more than the limit"):
        processor.load(png_header(8000, 5000))  # 40 M pixels: over our 32 Mi limit, under PIL's own
    with pytest.raises(ValueError, match="more than the limit"):
        processor.load(png_header(20000, 20000))  # a decompression bomb by PIL's measure too
    no_resize = ImageProcessorConfig(do_resize=False, crop_height=8, crop_width=8)
    small_limit = ImageProcessor(no_resize, max_image_pixels=100)
    with pytest.raises(ValueError, match="11x10 pixels, more than the limit of 100"):
        small_limit.load(encode(Image.fromarray(noise(10, 11))))
    assert small_limit.load(encode(Image.fromarray(noise(10, 10)))).shape == (10, 10, 3)


def test_extreme_aspect_ratios_are_refused():
    # 20,000 pixels, but resized to a 224-pixel shortest side it would be 224 x 4,480,000.
    strip = encode(Image.fromarray(noise(1, 20000)))
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        ImageProcessor(ImageProcessorConfig()).load(strip)
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        ImageProcessor(ImageProcessorConfig()).preprocess(noise(1, 20000))
    assert ImageProcessor(ImageProcessorConfig()).load(encode(Image.fromarray(noise(1, 100)))).shape == (1, 100, 3)


@pytest.mark.parametrize("data, message", [
    (b"", "non-empty bytes"),
    ("not bytes", "non-empty bytes"),
    (b"definitely not an image", "cannot read the image"),
    (encode(Image.fromarray(noise(64, 64)), "TIFF"), "cannot read the image"),  # a format we do not open
    (encode(Image.fromarray(noise(64, 64)))[:300], "cannot decode the PNG image"),  # truncated pixel data
])
def test_bad_bytes_raise_value_error(data, message):
    with pytest.raises(ValueError, match=message):
        ImageProcessor(ImageProcessorConfig()).load(data)


def test_load_gives_rgb_pixels_and_preprocess_checks_them():
    processor = ImageProcessor(ImageProcessorConfig())
    rgb = processor.load(encode(Image.fromarray(noise(20, 30, 4), mode="RGBA")))
    assert rgb.dtype == np.uint8 and rgb.shape == (20, 30, 3)
    assert processor.preprocess(rgb).shape == (3, 224, 224)
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        processor.preprocess(np.zeros((20, 30, 4), np.uint8))
    with pytest.raises(ValueError, match="max_image_pixels"):
        ImageProcessor(ImageProcessorConfig(), max_image_pixels=0)
