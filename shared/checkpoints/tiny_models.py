"""Tiny random checkpoints of every supported text family for fast tests, built from a transformers config.

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
    # Per-head q/k RMSNorm, head_dim from the config (heads * head_dim != hidden_size). Untied: tied to the
    # scaled lm_head, the embeddings would outweigh every layer and each step repeat the token before.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False,
        random_norms=True,
    ),
    # Sparse layers 0 and 2 (layer 1 dense, by mlp_only_layers), 8 experts, top-2 without renormalisation
    # (norm_topk_prob false: the path Mixtral never takes), q/k RMSNorm.
    "qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1],
        random_norms=True,
    ),
    # Every layer sparse, 4 experts, top-2 renormalised, GQA 4:2, a sliding window shorter than the
    # longest prompts.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=128, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        num_local_experts=4, num_experts_per_tok=2, sliding_window=96,
        random_norms=True,
    ),
    # Gemma 3: 8 layers, sliding (window 12, shorter than most test prompts) but for layer 5, the global one
    # (HF's pattern of 5 to 1), whose RoPE has its own base and linear scaling (as Gemma 3 4B and up); an
    # attention scale of its own (query_pre_attn_scalar is not head_dim), soft-capped logits, GQA 4:2,
    # GeGLU, four norms a layer. Untied, as qwen3.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=128, intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        query_pre_attn_scalar=48, sliding_window=12, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        random_norms=True,
    ),
}
# Larger random checkpoints for benchmarks, never tests: a tiny family's config with these changes, built by
# `epdserve model bench-<family>`.
BENCH_CONFIGS = {
    # Qwen3-30B-A3B's layout scaled down: every layer sparse, 16 experts of 256, top-4 renormalised
    # (norm_topk_prob), GQA 8:2 of head_dim 64; 8 layers, hidden 512. 106M parameters (424 MB in float32),
    # 43M of them active per token, 25M of those the lm_head. Each dimension is a multiple of 32 and head_dim
    # one vLLM's CPU attention takes, so vLLM's CPU build runs it too (its grouped-GEMM experts, float32 or
    # bfloat16).
    "qwen3-moe": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
}
LM_HEAD_SCALE = 8.0
NORM_WEIGHT_SPREAD = 0.5  # random_norms: RMSNorm scales uniform in 1 +- this


def build_tiny_model(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a random `arch` checkpoint (config.json, model.safetensors, tokenizer) to `out`;
    `config_overrides` change its HF config (a test's variant of a family; `vocab_size` for a tokenizer with
    tokens added)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {arch!r}; choose one of {sorted(TINY_CONFIGS)}")
    params = {**TINY_CONFIGS[arch], **config_overrides}
    # RMSNorm weights drawn around 1 instead of HF's all-ones init, so that a norm weight loaded into the
    # wrong place (q_norm for k_norm, a layer's for another's) changes the output.
    random_norms = params.pop("random_norms", False)
    tokenizer_config = AutoConfig.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(
        params.pop("model_type"), vocab_size=params.pop("vocab_size", tokenizer_config.vocab_size),
        bos_token_id=tokenizer_config.bos_token_id,
        eos_token_id=tokenizer_config.eos_token_id, pad_token_id=tokenizer_config.eos_token_id,
        initializer_range=0.05, dtype="float32", **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Gemma's norms scale by 1 + weight.
    center = 0.0 if config.model_type == "gemma3_text" else 1.0
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
        for name, param in model.named_parameters():
            if random_norms and name.endswith("norm.weight"):
                param.uniform_(center - NORM_WEIGHT_SPREAD, center + NORM_WEIGHT_SPREAD)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
