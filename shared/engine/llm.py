"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""
from __future__ import annotations

import itertools
import queue
from dataclasses import replace
from typing import Sequence

from epdserve.shared.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig,
                                    SpeculativeConfig)
from epdserve.shared.engine.default_logging import use_default_logging
from epdserve.shared.engine.kv_connector import LoadResult
from epdserve.shared.engine.llm_engine import LLMEngine, PromptType
from epdserve.shared.engine.lora_request import LoRARequest
from epdserve.shared.engine.outputs import RequestOutput
from epdserve.shared.engine.sampling_params import RequestOutputKind, SamplingParams
from epdserve.shared.models.weights import check_quantization


def build_engine_config(
    model: str,
    dtype: str = "float32",
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 1024,
    budget_policy: str = "prompts",
    kv_cache_memory_bytes: int | None = None,
    num_kv_blocks: int | None = None,
    kv_cache_memory_fraction: float | None = None,
    max_model_len: int | None = None,
    attention_backend: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    grammar_compile_timeout: float = 10.0,
    speculative_config: str | dict | SpeculativeConfig | None = None,
    kv_offloading_size: float = 0.0,
    kv_offloading_path: str | None = None,
    kv_offloading_save_finished: bool = False,
    enable_lora: bool = False,
    max_loras: int = 4,
    max_lora_rank: int = 16,
    lora_modules: tuple[tuple[str, str], ...] = (),
    lora_roots: tuple[str, ...] | None = None,
    max_lora_bytes: int = 1 << 30,
    profile_moe: bool = False,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> EngineConfig:
    """`kv_offloading_size`: GiB of the local offload tier (0: none), as vLLM's `--kv-offloading-size`;
    `kv_offloading_path`: the folder its file goes in (default: the temp folder); `quantization`: "int8"
    quantizes the dense linear layers of a float checkpoint at load ("gguf": the folder's GGUF file, which is
    served as it ships anyway)."""
    check_quantization(quantization, model)
    model_config = ModelConfig.from_pretrained(model, dtype, max_model_len)
    if quantization == "int8":
        model_config = replace(model_config, quantization="int8")
    speculative = SpeculativeConfig.parse(speculative_config)
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size, kv_cache_memory_bytes, num_kv_blocks, enable_prefix_caching,
                          kv_cache_memory_fraction, int(kv_offloading_size * (1 << 30)), kv_offloading_path,
                          kv_offloading_save_finished, cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, budget_policy),
        device=device,
        attention_backend=attention_backend,
        seed=seed,
        grammar_compile_timeout=grammar_compile_timeout,
        speculative=None if speculative is None else speculative.with_draft(dtype, model_config.max_model_len),
        lora=LoRAConfig(max_loras, max_lora_rank, tuple(lora_modules),
                        None if lora_roots is None else tuple(lora_roots), max_lora_bytes) if enable_lora else None,
        profile_moe=profile_moe,
    )


class LLM:
    """Offline batched generation. Keyword arguments are those of `build_engine_config`:
    model, dtype ("float32" | "bfloat16"), block_size, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, budget_policy ("prompts" | "shared", see step_budget.py), kv_cache_memory_bytes or num_kv_blocks (default: kv_cache_memory_fraction of the
    memory available, see kv_cache_budget.py), max_model_len, attention_backend
    ("auto" | "torch" | "triton"), device, seed, speculative_config (vLLM's: a dict or its JSON text, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}), kv_offloading_size (GiB of
    the local offload tier), kv_offloading_path, kv_offloading_save_finished, enable_lora with max_loras,
    max_lora_rank, lora_modules, lora_roots (the folders other adapters may come from; None: any) and
    max_lora_bytes (the largest adapter weights file read), profile_moe (a mixture-of-experts model's sparse MLPs timed by part in
    `engine.stats().step_seconds`, see step_timer.py), kv_cache_dtype (vLLM's: "auto" | "bfloat16" | "fp8" |
    "fp8_e4m3" | "fp8_e5m2", and "int8" with a scale per token and head: what the KV pool stores)."""

    def __init__(self, model: str, **kwargs) -> None:
        use_default_logging()
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self._ids = itertools.count()
        # Loads from the engine's own tier end on its worker thread; `_run` applies them between steps.
        self._loads_done: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self.engine.bind_connectors(self._loads_done.put, lambda request_id: None)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, or {"prompt_token_ids": [...]}); outputs in order.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._loras_per_prompt(lora_request, len(prompts))
        self._check_lora_room(loras)
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        requests = [self.engine.make_request(str(next(self._ids)), p, sp, lora_request=lora)
                    for p, sp, lora in zip(prompts, params, loras)]
        return self._run(requests)

    def _check_lora_room(self, loras: list[LoRARequest | None]) -> None:
        """The call's requests all run at once: their adapters must fit the slots together."""
        names = {lora.lora_name for lora in loras if lora is not None}
        lora_config = self.engine.config.lora
        if names and lora_config is not None and len(names) > lora_config.max_loras:
            raise ValueError(f"no room for LoRA adapters {sorted(names)} in one call: {len(names)} adapters, "
                             f"max_loras {lora_config.max_loras}")

    @staticmethod
    def _loras_per_prompt(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
        return loras

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted by the tokenizer's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(c, add_generation_prompt, **(chat_template_kwargs or {}))}
                   for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        return [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in sampling_params]

    def _run(self, requests) -> list[RequestOutput]:
        for request in requests:
            self.engine.add_request(request.request_id, request)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs = self._finish_loads(wait=not self.engine.has_work())
            outputs += self.engine.step() if self.engine.has_work() else []
            for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
        return [finals[r.group_id] for r in requests]

    def _finish_loads(self, wait: bool) -> list[RequestOutput]:
        """Apply the loads that ended; with `wait`, wait a while for one first (nothing else can run)."""
        outputs: list[RequestOutput] = []
        try:
            result = self._loads_done.get(timeout=1.0) if wait else self._loads_done.get_nowait()
            while True:
                outputs += self.engine.finish_load(result)
                result = self._loads_done.get_nowait()
        except queue.Empty:
            return outputs
