"""The engine core every service runs: requests, the scheduler over a paged KV block manager, the model
runner and sampler, and the two front doors (`LLM` offline, `AsyncLLM` for a service's event loop).

What a service may use of it is exported here, and services import it from here only (the layer contracts
in pyproject.toml keep them out of the modules below): `AsyncLLM` and its errors, the parameters and
outputs, the KV connector interface, the engine config's builder, and the prefill's share of a request.
`Request` is the handle `AsyncLLM.make_request` returns, for type hints. Names are imported on first use:
the proxy imports the parameters without loading torch.
"""
import importlib

_EXPORTS = {
    "AsyncLLM": "async_llm", "EngineDeadError": "async_llm", "RequestFailedError": "async_llm",
    "InputsUnavailableError": "async_llm",
    "SamplingParams": "sampling_params", "RequestOutputKind": "sampling_params",
    "StructuredOutputsParams": "sampling_params", "LOGIT_BIAS_MAX": "sampling_params",
    "LOGIT_BIAS_MIN": "sampling_params", "MAX_LOGPROBS": "sampling_params", "SEED_MAX": "sampling_params",
    "SEED_MIN": "sampling_params", "sequence_seed": "sampling_params",
    "RequestOutput": "outputs", "EngineStats": "outputs", "RequestMetrics": "outputs", "KVTierStats": "outputs",
    "RESTORE_SECONDS_BUCKETS": "outputs", "KVEventLog": "kv_events", "TierEvents": "kv_events",
    "OffloadFile": "offload_file",
    "KVConnector": "kv_connector", "KVLoad": "kv_connector", "LoadResult": "kv_connector",
    "EvictedBlock": "kv_connector",
    "build_engine_config": "llm", "PREFILL_OUTPUT_TOKENS": "handoff", "Request": "request",
    "LoRARequest": "lora_request", "LoRAAdapterError": "lora_manager", "NoLoRASlotError": "lora_manager",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
