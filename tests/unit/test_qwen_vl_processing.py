"""The proxy's side of Qwen2.5-VL: an image's token count from its size (HF's smart_resize arithmetic,
without pixels), its M-RoPE positions, and what ModelConfig reads from the checkpoint in both
transformers layouts."""
import json

import pytest

from epdserve.shared.config import ModelConfig
from epdserve.shared.processing.mrope import mrope_positions
from epdserve.shared.processing.multimodal import MultiModalPlaceholder, expand_image_tokens, ImagePromptSpec
from epdserve.shared.processing.qwen_image_processor import QwenImageProcessorConfig

SIZES = [(1, 1), (28, 28), (56, 56), (60, 60), (90, 230), (230, 90), (300, 400), (1080, 1920), (4000, 3000),
         (14, 2700), (17, 3333), (511, 512), (333, 29), (7, 1400)]


@pytest.mark.parametrize("settings", [dict(), dict(min_pixels=56 * 56, max_pixels=80 * 28 * 28),
                                      dict(min_pixels=4 * 28 * 28, max_pixels=16384 * 28 * 28)])
def test_grid_equals_hf_smart_resize(settings):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    config = QwenImageProcessorConfig(**settings)
    for height, width in SIZES:
        expected = smart_resize(height, width, 28, config.min_pixels, config.max_pixels)
        assert config.resized_size(height, width) == expected, (height, width)
        t, h, w = config.grid(height, width)
        assert (t, h * 14, w * 14) == (1, *expected)
        assert config.num_tokens(height, width) == h * w // 4


def test_grid_refuses_a_strip_hf_refuses():
    with pytest.raises(ValueError, match="aspect ratio"):
        QwenImageProcessorConfig().grid(10, 2010)


def test_settings_from_preprocessor_config():
    raw = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 62720},
           "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    config = QwenImageProcessorConfig.from_dict(raw)
    assert (config.min_pixels, config.max_pixels) == (3136, 62720)
    # transformers 4 spelled the bounds as min_pixels / max_pixels
    legacy = QwenImageProcessorConfig.from_dict({"image_processor_type": "Qwen2VLImageProcessor",
                                                 "min_pixels": 3136, "max_pixels": 62720})
    assert legacy == config and legacy.canonical_json() == config.canonical_json()
    assert QwenImageProcessorConfig.from_dict({**raw, "merge_size": 1}).canonical_json() != config.canonical_json()
    with pytest.raises(ValueError, match="unsupported image processor"):
        QwenImageProcessorConfig.from_dict({"image_processor_type": "CLIPImageProcessor"})


def test_positions_of_text_and_images():
    # text(2) image 1x2x3 text(1) image 1x1x1 text(2)
    phs = (MultiModalPlaceholder(2, 6, "a"), MultiModalPlaceholder(9, 1, "b"))
    t, h, w = mrope_positions(12, phs, [(1, 2, 3), (1, 1, 1)])
    assert t == (0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 8)
    assert h == (0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 8)
    assert w == (0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8)
    # No image: the three rows are the token indices.
    assert mrope_positions(3, (), []) == ((0, 1, 2),) * 3
    with pytest.raises(ValueError, match="does not fit"):
        mrope_positions(12, phs, [(1, 2, 2), (1, 1, 1)])
    with pytest.raises(ValueError, match="grids"):
        mrope_positions(12, phs, [(1, 2, 3)])


def test_images_expand_by_their_own_token_counts():
    spec = ImagePromptSpec(9, None)
    out = expand_image_tokens([1, 9, 2, 9, 3], spec, ["a", "b"], [3, 2])
    assert out.token_ids == [1, 9, 9, 9, 2, 9, 9, 3]
    assert out.mm_placeholders == (MultiModalPlaceholder(1, 3, "a"), MultiModalPlaceholder(5, 2, "b"))
    with pytest.raises(ValueError, match="one per image"):
        expand_image_tokens([1, 9], spec, ["a"])


TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


def test_model_config_of_both_transformers_layouts(tmp_path):
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "text_config": {**TEXT, "model_type": "qwen2_5_vl_text", "tie_word_embeddings": False,
                              "attention_bias": False, "mlp_bias": False,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [2, 3, 3]}},
              "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.architecture, config.mrope_section, config.rope_scaling) == ("Qwen2ForCausalLM", (2, 3, 3), None)
    assert config.qkv_bias and not config.o_bias and config.rope_theta == 1e6
    # transformers 4: the language model's settings at the top level, M-RoPE as a "scaling" type.
    flat = {**TEXT, "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert ModelConfig.from_pretrained(tmp_path) == config
    (tmp_path / "config.json").write_text(json.dumps({**flat, "rope_scaling": {"type": "mrope",
                                                                              "mrope_section": [2, 3, 4]}}))
    with pytest.raises(ValueError, match="summing to head_size / 2 = 8"):
        ModelConfig.from_pretrained(tmp_path)


def test_the_processor_is_found_in_either_file(tmp_path):
    from epdserve.shared.processing.multimodal import load_image_processor
    from epdserve.shared.processing.qwen_image_processor import QwenImageProcessor

    raw = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 62720}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": raw}))
    combined = load_image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    single = load_image_processor(tmp_path)
    assert isinstance(combined, QwenImageProcessor) and combined.config == single.config
    assert combined.config == QwenImageProcessorConfig(min_pixels=3136, max_pixels=62720)
