"""Image identity (mm_hash), image token counts and placeholder expansion."""
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.shared.processing.image_processor import ImageProcessor, ImageProcessorConfig
from epdserve.shared.processing.vision_config import LlavaEncoderConfig
from epdserve.shared.processing.multimodal import ImagePromptSpec, expand_image_tokens, mm_hash
from epdserve.shared.processing.multimodal import MultiModalPlaceholder

IMAGE = 99  # the image token id in these tests


def pixels(height=6, width=5, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(rgb: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def test_mm_hash_is_the_content_not_the_file():
    rgb = pixels(40, 30)
    processor = ImageProcessor(ImageProcessorConfig())
    files = [encode(rgb, fmt) for fmt in ("PNG", "BMP", "WEBP")]
    assert len(set(files)) == 3
    hashes = {mm_hash(processor.load(data), processor.config) for data in files}
    assert hashes == {mm_hash(rgb, processor.config)}
    assert len(hashes.pop()) == 64  # sha256, hex


def test_mm_hash_changes_with_any_pixel_size_or_setting():
    rgb = pixels()
    config = ImageProcessorConfig()
    base = mm_hash(rgb, config)
    changed = rgb.copy()
    changed[5, 4, 2] ^= 1
    assert mm_hash(changed, config) != base
    # Same bytes, other shape.
    assert mm_hash(rgb.reshape(5, 6, 3), config) != base
    assert mm_hash(rgb, ImageProcessorConfig(shortest_edge=336, crop_height=336, crop_width=336)) != base
    assert mm_hash(rgb, ImageProcessorConfig(image_mean=(0.5, 0.5, 0.5))) != base
    # A non-contiguous view hashes as its contents.
    assert mm_hash(np.asfortranarray(rgb), config) == base


def test_mm_hash_is_stable():
    # Caches on different hosts and versions compare these: a change here invalidates them all.
    golden = "caeb99a33de5b9fac7229980084feea4be375d7383284c181d1d1768d2d02f36"
    assert mm_hash(np.arange(90, dtype=np.uint8).reshape(6, 5, 3), ImageProcessorConfig()) == golden


def test_mm_hash_refuses_non_rgb():
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        mm_hash(pixels().astype(np.float32), ImageProcessorConfig())
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        mm_hash(np.zeros((4, 4), np.uint8), ImageProcessorConfig())


def test_expand_image_tokens():
    spec = ImagePromptSpec(IMAGE, 3)
    out = expand_image_tokens([1, IMAGE, 2, IMAGE, IMAGE, 3], spec, ["a", "b", "c"])
    assert out.token_ids == [1, IMAGE, IMAGE, IMAGE, 2] + [IMAGE] * 6 + [3]
    assert out.mm_placeholders == (MultiModalPlaceholder(1, 3, "a"), MultiModalPlaceholder(5, 3, "b"),
                                   MultiModalPlaceholder(8, 3, "c"))
    assert expand_image_tokens([1, 2], spec, []) == ([1, 2], ())
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_tokens([IMAGE, 5, IMAGE], spec, ["a"])
    with pytest.raises(ValueError, match="0 image placeholders but 1 images"):
        expand_image_tokens([5], spec, ["a"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 98), st.just(IMAGE)), max_size=40), st.integers(1, 20))
def test_expansion_keeps_text_and_places_each_image(token_ids, num_image_tokens):
    spec = ImagePromptSpec(IMAGE, num_image_tokens)
    hashes = [f"h{i}" for i in range(token_ids.count(IMAGE))]
    out = expand_image_tokens(token_ids, spec, hashes)
    assert len(out.token_ids) == len(token_ids) + len(hashes) * (num_image_tokens - 1)
    assert [t for t in out.token_ids if t != IMAGE] == [t for t in token_ids if t != IMAGE]
    assert [p.mm_hash for p in out.mm_placeholders] == hashes
    covered = set()
    for p in out.mm_placeholders:
        assert p.length == num_image_tokens
        assert out.token_ids[p.offset:p.offset + p.length] == [IMAGE] * num_image_tokens
        covered.update(range(p.offset, p.offset + p.length))
    assert covered == {i for i, t in enumerate(out.token_ids) if t == IMAGE}


def llava_config(**overrides) -> dict:
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 49152,
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 224,
                                "patch_size": 14},
              "text_config": {"model_type": "llama", "hidden_size": 96}}
    config.update(overrides)
    return config


def test_prompt_spec_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llava_config()))
    assert ImagePromptSpec.from_pretrained(tmp_path) == ImagePromptSpec(49152, 256)
    (tmp_path / "config.json").write_text(json.dumps(llava_config(vision_feature_select_strategy="full",
                                                                  image_token_id=7)))
    assert ImagePromptSpec.from_pretrained(tmp_path) == ImagePromptSpec(7, 257)  # the class token is kept


def test_llava_config_defaults_are_llava_1_5():
    # A config that leaves everything out means LLaVA 1.5's CLIP ViT-L/14 at 336 pixels.
    config = LlavaEncoderConfig.from_dict({"model_type": "llava"})
    assert (config.vision.image_size, config.vision.patch_size, config.vision.num_layers) == (336, 14, 24)
    assert config.num_image_tokens == 576 and config.feature_layers == (23,) and config.num_tower_layers == 23
    assert config.image_token_id == 32000 and config.text_hidden_size == 4096


def test_feature_layers_are_normalised():
    config = LlavaEncoderConfig.from_dict(llava_config(vision_feature_layer=[-4, 1, -1]))
    assert config.feature_layers == (0, 1, 3) and config.num_tower_layers == 3


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="llama", architectures=["LlamaForCausalLM"]), "not a LLaVA checkpoint"),
    (dict(vision_feature_layer=-5), "outside the tower's 4 hidden states"),
    (dict(vision_feature_layer=4), "outside the tower's 4 hidden states"),
    (dict(vision_feature_layer=[]), "outside"),
    (dict(vision_feature_select_strategy="cls"), "unsupported vision_feature_select_strategy"),
    (dict(projector_hidden_act="swish7"), "unsupported activation"),
    (dict(vision_config={"model_type": "siglip_vision_model"}), "unsupported vision tower"),
    (dict(vision_config={"model_type": "clip_vision_model", "image_size": 225, "patch_size": 14}),
     "not a multiple of patch_size"),
])
def test_bad_llava_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        LlavaEncoderConfig.from_dict(llava_config(**overrides))


def test_prompt_spec_needs_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ImagePromptSpec.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="positive"):
        ImagePromptSpec(IMAGE, 0)
