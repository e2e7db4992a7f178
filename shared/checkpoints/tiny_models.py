"""Tiny random Llama and Qwen2 checkpoints for fast tests, built from a transformers config.

They use the default model's tokenizer (so prompts are real text) and a fixed seed (so every build is
the same model). The lm_head is scaled up so logits are spread wide: greedy choices are then far from
ties, and float32 rounding differences between batching schemes cannot flip them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

TINY_CONFIGS = {
    # GQA 4:2, tied embeddings, Llama 3 RoPE scaling.
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    # MQA 4:1, untied embeddings, q/k/v biases.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        use_sliding_window=False,
    ),
}
LM_HEAD_SCALE = 8.0


def build_tiny_model(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random `arch` checkpoint (config.json, model.safetensors, tokenizer) to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {arch!r}; choose one of {sorted(TINY_CONFIGS)}")
    params = dict(TINY_CONFIGS[arch])
    tokenizer_config = AutoConfig.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(
        params.pop("model_type"), vocab_size=tokenizer_config.vocab_size, bos_token_id=tokenizer_config.bos_token_id,
        eos_token_id=tokenizer_config.eos_token_id, pad_token_id=tokenizer_config.eos_token_id,
        initializer_range=0.05, dtype="float32", **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
