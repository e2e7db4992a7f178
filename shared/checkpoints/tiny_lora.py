"""LoRA adapters for tests, made with PEFT's own classes on a (tiny) base model, from a fixed seed.

PEFT initialises B to zero, which would make an adapter a no-op; here A and B are both drawn, B large
enough that greedy output differs from the base model's, so a test that ignored the adapter would fail.
Variants exercise the format: the modules targeted, the rank, lora_alpha and rsLoRA.
"""
from __future__ import annotations

from pathlib import Path

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_LORAS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp-rslora": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "qk-rank2": dict(r=2, lora_alpha=2, target_modules=["q_proj", "k_proj"]),
}
B_STD = 0.4  # of the drawn B: output changes, yet stays a small correction of the base model


def build_tiny_lora(base: str | Path, out: str | Path, variant: str = "all", seed: int = 0, **overrides) -> Path:
    """Write a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) for `base` to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if variant not in TINY_LORAS:
        raise ValueError(f"unknown tiny LoRA {variant!r}; choose one of {sorted(TINY_LORAS)}")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **{**TINY_LORAS[variant], **overrides})
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * B_STD)
    out = Path(out)
    peft_model.save_pretrained(out)
    return out
