"""What names a request's LoRA adapter, as vLLM spells it: `LoRARequest(lora_name, lora_int_id, lora_path)`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients call it (an OpenAI `model`)
    lora_int_id: int  # positive; vLLM's id, kept for its callers' sake (the name identifies the adapter here)
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")
