"""epdserve: disaggregated encoder / prefill / decode LLM serving.

The offline API mirrors vLLM's:

    from epdserve import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-folder")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
"""
from epdserve.shared.async_llm import AsyncLLM
from epdserve.shared.llm import LLM
from epdserve.shared.outputs import CompletionOutput, RequestOutput
from epdserve.shared.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
