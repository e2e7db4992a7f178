"""A tiny random Qwen2.5-VL checkpoint (`Qwen2_5_VLForConditionalGeneration`) for fast tests.

Built from transformers' own `Qwen2_5_VLConfig` with a fixed seed, as the tiny text models are: a small
windowed vision tower (2x2 merged patches per window side, full attention in two of its four blocks) and a
two-layer Qwen2 language model with 3-D M-RoPE. Its tokenizer is the default model's with Qwen2-VL's vision
tokens added (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`), and its image processor
is HF's PIL-backed `Qwen2VLImageProcessor`, whose pixel bounds keep images to a
few dozen tokens (saved on its own with the tokenizer: HF's combined processor insists on a video processor,
which needs torchvision). transformers loads, runs and `generate`s with the folder, which is what the tests compare
against. The lm_head is scaled up as in tiny_models.py, so greedy choices are far from ties.
"""
from __future__ import annotations

from pathlib import Path

from epdserve.shared.checkpoints.model_folder import write_whole

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# window_size 56 pixels = 2 merged tokens (2 x 2 patches of 14) a side: most test images span several
# windows, and the last row and column of windows are partial.
TINY_VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=128,
                   fullatt_block_indexes=[1, 3], tokens_per_second=2, hidden_act="silu")
# Qwen2's attention (q/k/v biases), GQA 4:2, head_size 32 split by M-RoPE into 4 temporal, 6 height and
# 6 width frequency pairs.
TINY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                 use_sliding_window=False, initializer_range=0.05)
# An image becomes between 4 and 80 tokens (merged 2x2 patches of 14 pixels: 28 x 28 pixels per token).
TINY_IMAGE_PROCESSOR = dict(min_pixels=56 * 56, max_pixels=80 * 28 * 28, patch_size=14, temporal_patch_size=2,
                            merge_size=2)
LM_HEAD_SCALE = 8.0
NORM_WEIGHT_SPREAD = 0.5

# SmolLM2's template (same text for string contents) taking OpenAI-style content lists, images written as
# Qwen2-VL writes them: <|vision_start|><|image_pad|><|vision_end|>, the pad expanded per image later.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'input_image'] %}"
    "{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_qwen2_5_vl(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL checkpoint (float32, processor and tokenizer included) to `out`; the same
    seed gives the same checkpoint. `out` is replaced as a whole, never left half-written."""
    out = Path(out)
    return write_whole(out, lambda tmp: _build(tmp, Path(tokenizer_dir), seed))


def _build(out: Path, tokenizer_dir: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text_vocab = len(tokenizer)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    if sorted(ids.values()) != list(range(text_vocab, text_vocab + len(VISION_TOKENS))):
        raise ValueError("the vision tokens did not become new tokens at the end of the vocabulary")
    tokenizer.chat_template = CHAT_TEMPLATE
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    config = Qwen2_5_VLConfig(
        vision_config=TINY_VISION,
        text_config=dict(TINY_TEXT, vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        # Norm weights away from HF's all-ones init (a norm loaded into the wrong place then shows), and the
        # vision tower's weights drawn in name order by our own generator (HF's init leaves some at zero).
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.copy_(1 + NORM_WEIGHT_SPREAD * (2 * torch.rand(param.shape, generator=generator) - 1))
            elif "visual." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor().save_pretrained(out)


def image_processor():
    """HF's PIL-backed Qwen2-VL image processor with the tiny checkpoint's settings."""
    try:  # transformers >= 5: the PIL-backed class has its own name
        from transformers import Qwen2VLImageProcessorPil as PilImageProcessor
    except ImportError:  # transformers 4: the plain (slow) class is the PIL one
        from transformers import Qwen2VLImageProcessor as PilImageProcessor
    return PilImageProcessor(**TINY_IMAGE_PROCESSOR)
