"""A demo multimodal checkpoint: SmolLM2-135M-Instruct behind a small, untrained CLIP vision tower.

The folder is a genuine HF `LlavaForConditionalGeneration` checkpoint (transformers loads, runs and
`generate`s with it), so the whole image path can be exercised and checked against transformers
offline: no pretrained vision-language model can be fetched here. Its language model is SmolLM2's,
weights unchanged; the vision tower and projector are random (fixed seed), so what it says about an
image is meaningless.

`<image>` is added to SmolLM2's tokenizer as one new special token. Its embedding row is zero: as an
input it is always overwritten by an image's embeddings, and as an output its logit is exactly 0,
below SmolLM2's top logit in practice, so text-only prompts get SmolLM2's own greedy output.
"""
from __future__ import annotations

import logging
from pathlib import Path

from epdserve.shared.checkpoints.model_folder import write_whole

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
# A small ViT at CLIP's usual geometry: 224-pixel images, 14-pixel patches -> 16 x 16 = 256 patches.
DEMO_VISION_CONFIG = dict(
    model_type="clip_vision_model", hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=6, image_size=224, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    projection_dim=384,
)
# LLaVA 1.5's choices: the penultimate layer's patch states (class token dropped), a GELU MLP projector.
DEMO_LLAVA_CONFIG = dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", multimodal_projector_bias=True)
DEMO_IMAGE_PROCESSOR = dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
INIT_STD = 0.02

# SmolLM2's template (same text for string contents) that also takes OpenAI-style content lists:
# text parts in order, one image token per image part.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'input_image'] %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_llava_demo(out: Path, text_model_dir: Path, seed: int = 0) -> Path:
    """Write the demo LLaVA checkpoint (float32, with processor and tokenizer) to `out`; return `out`.

    `text_model_dir` is the SmolLM2 folder of `epdserve.shared.checkpoints.default_model.prepare_default_model()`.
    The same seed gives the same checkpoint. `out` is replaced as a whole, never left half-written.
    """
    out = Path(out)
    logger.info("building the demo model in %s: SmolLM2's weights behind a random CLIP vision tower (about ten "
                "seconds)", out)
    return write_whole(out, lambda tmp: _build(tmp, Path(text_model_dir), seed))


def _build(out: Path, text_model_dir: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlavaConfig, LlavaForConditionalGeneration

    from epdserve.shared.models.weights import GGUF_WEIGHTS, iterate_weights

    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    text_vocab = len(tokenizer)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if len(tokenizer) != text_vocab + 1 or image_token_id != text_vocab:
        raise ValueError(f"{IMAGE_TOKEN} did not become a new token at the end of the vocabulary")
    tokenizer.chat_template = CHAT_TEMPLATE

    text_config = AutoConfig.from_pretrained(text_model_dir)
    if text_config.vocab_size != text_vocab:
        raise ValueError(f"the text model's vocabulary ({text_config.vocab_size}) differs from its tokenizer's "
                         f"({text_vocab})")
    text_config.vocab_size = text_vocab + 1
    text_dict = {k: v for k, v in text_config.to_dict().items() if k not in ("_name_or_path", "_model_name_or_path")}
    config = LlavaConfig(vision_config=DEMO_VISION_CONFIG, text_config=text_dict,
                         image_token_id=image_token_id, image_seq_length=_num_image_tokens(),
                         tie_word_embeddings=text_config.tie_word_embeddings, **DEMO_LLAVA_CONFIG)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    state = {}
    for name, tensor in iterate_weights(text_model_dir):
        if name == "lm_head.weight" and text_config.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            tensor = torch.cat([tensor, tensor.new_zeros(1, tensor.shape[1])])  # the <image> row
        key = "lm_head.weight" if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
        state[key] = tensor.float()
    state.update(_random_encoder_weights(model, seed))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and text_config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"demo weights do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.generation_config = GenerationConfig.from_pretrained(text_model_dir)
    model.save_pretrained(out)
    if (text_model_dir / GGUF_WEIGHTS).is_file():  # the engine serves SmolLM2's weights as they ship (4-bit)
        (out / GGUF_WEIGHTS).symlink_to((text_model_dir / GGUF_WEIGHTS).resolve())
    processor = _processor(tokenizer)
    processor.save_pretrained(out)
    # transformers 5 nests the image processor in processor_config.json; older versions (and other
    # readers) look for preprocessor_config.json.
    processor.image_processor.save_pretrained(out)


def _num_image_tokens() -> int:
    grid = DEMO_VISION_CONFIG["image_size"] // DEMO_VISION_CONFIG["patch_size"]
    return grid * grid  # "default" strategy: patches only


def _random_encoder_weights(model, seed: int) -> dict:
    """Seeded weights for the vision tower and projector, drawn in name order with our own generator (so
    they do not depend on how a transformers version initialises modules). Layer norms get gains near 1."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in sorted(model.state_dict().items()):
        if "vision_tower." not in name and "multi_modal_projector." not in name:
            continue
        if not param.is_floating_point():
            continue
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if "norm" in name and name.endswith(".weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith("class_embedding"):
            weights[name] = noise * param.shape[0] ** -0.5
        else:
            weights[name] = INIT_STD * noise
    return weights


def _processor(tokenizer):
    from transformers import LlavaProcessor

    try:  # transformers >= 5: the PIL-backed class has its own name
        from transformers import CLIPImageProcessorPil as PilImageProcessor
    except ImportError:  # transformers 4: the plain (slow) class is the PIL one
        from transformers import CLIPImageProcessor as PilImageProcessor
    return LlavaProcessor(
        image_processor=PilImageProcessor(**DEMO_IMAGE_PROCESSOR), tokenizer=tokenizer,
        patch_size=DEMO_VISION_CONFIG["patch_size"],
        vision_feature_select_strategy=DEMO_LLAVA_CONFIG["vision_feature_select_strategy"],
        num_additional_image_tokens=1,  # the class token
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN)
