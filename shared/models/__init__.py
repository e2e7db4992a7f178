"""Model classes by HF architecture name."""


def model_class(architecture: str):
    """The class that runs `architecture` (one of config.SUPPORTED_ARCHITECTURES); imported on first use:
    what only reads model configs (the proxy) loads no torch."""
    from epdserve.shared.models.llama import LlamaForCausalLM

    # One decoder for every supported family: where they differ, ModelConfig says so (qk_norm, moe, biases,
    # sliding layers, Gemma 3's norms, embeddings, activation, RoPE and logit cap).
    return {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
            "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": LlamaForCausalLM,
            "Qwen3MoeForCausalLM": LlamaForCausalLM, "MixtralForCausalLM": LlamaForCausalLM,
            "Gemma3ForCausalLM": LlamaForCausalLM}[architecture]
