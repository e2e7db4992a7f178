"""epdserve: disaggregated encoder / prefill / decode LLM serving.

The offline API mirrors vLLM's:

    from epdserve import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-folder")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))

Names are imported on first use, so `import epdserve.transport` (say) does not load the engine.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "epdserve.shared.engine.llm",
    "AsyncLLM": "epdserve.shared.engine.async_llm",
    "SamplingParams": "epdserve.shared.engine.sampling_params",
    "RequestOutputKind": "epdserve.shared.engine.sampling_params",
    "StructuredOutputsParams": "epdserve.shared.engine.sampling_params",
    "RequestOutput": "epdserve.shared.engine.outputs",
    "CompletionOutput": "epdserve.shared.engine.outputs",
    "LoRARequest": "epdserve.shared.engine.lora_request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'epdserve' has no attribute {name!r}")
