"""Model classes by HF architecture name."""


def model_class(architecture: str):
    """The class that runs `architecture` (one of config.SUPPORTED_ARCHITECTURES); imported on first use:
    what only reads model configs (the proxy) loads no torch."""
    from epdserve.shared.models.llama import LlamaForCausalLM

    return {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
            "Qwen2ForCausalLM": LlamaForCausalLM}[architecture]
