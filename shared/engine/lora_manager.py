"""The engine's LoRA adapters: those read from disk, and which of them sit in the model's `max_loras` slots.

An adapter is read (and checked) when a request first names it, then kept by name; it takes a slot when a
request using it is added, reusing its slot if it still has one. A slot is taken only from adapters no
unfinished request uses - the one used longest ago first - so a slot's weights never change under a
request. When every slot is in use the request is refused (`NoLoRASlotError`: retry later or elsewhere).

Reading an adapter touches nothing of the manager (`read`: any thread, so a service reads adapters off the
engine's thread); everything else - keeping one (`add`), forgetting it, the slots - is the engine thread's.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from epdserve.shared.config import LoRAConfig, ModelConfig
from epdserve.shared.engine.lora_request import LoRARequest
# LoRAAdapterError: exported from the engine package by this module's name.
from epdserve.shared.models.lora_adapter import LoRAAdapter, LoRAAdapterError, load_lora_adapter  # noqa: F401
from epdserve.shared.models.lora_roots import LoRARoots, check_adapter_name

logger = logging.getLogger(__name__)


class NoLoRASlotError(RuntimeError):
    """Every adapter slot holds an adapter that unfinished requests use: not this request's fault."""


class LoRAManager:
    """Sole owner of the adapters read and of the slots; writes the model's stacked weights."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig,
                 write_slot: Callable[[int, dict], None]) -> None:
        self.config = config
        self.model_config = model_config
        self._write_slot = write_slot  # (slot, weights) -> None; {} clears it
        self.adapters: dict[str, LoRAAdapter] = {}  # by name
        self.slots: list[LoRAAdapter | None] = [None] * config.max_loras
        self._last_used = [0] * config.max_loras
        self._clock = 0
        # Adapters other than the operator's start-up ones come only from inside these (None: from anywhere).
        self._roots = None if config.roots is None else LoRARoots(config.roots)
        self._named = set(config.modules)

    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter `lora` names, read from its path unless known already under that name and path
        (`find`, else `add` of what `read` reads)."""
        known = self.find(lora)
        return known if known is not None else self.add(self.read(lora))

    def find(self, lora: LoRARequest) -> LoRAAdapter | None:
        """The adapter known under `lora`'s name, if it was read from `lora`'s path."""
        known = self.adapters.get(lora.lora_name)
        return known if known is not None and known.path == lora.lora_path else None

    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter `lora` names, read from its path and checked, not kept (any thread); raises
        LoRAAdapterError (a ValueError) for an adapter this base model cannot serve, and - unless it is one
        of the start-up adapters (`modules`) - for a name that is no model name or a folder outside the
        roots."""
        roots = None
        if self._roots is not None and (lora.lora_name, lora.lora_path) not in self._named:
            try:
                check_adapter_name(lora.lora_name)
            except ValueError as exc:
                raise LoRAAdapterError(str(exc)) from None
            roots = self._roots
        return load_lora_adapter(lora.lora_name, lora.lora_path, self.model_config, self.config.max_lora_rank,
                                 self.config.max_bytes, roots)

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keep `adapter` (what `read` read) under its name, in place of any kept there."""
        self.adapters[adapter.name] = adapter
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", adapter.name, adapter.path,
                    adapter.rank, len(adapter.weights))
        return adapter

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (False if unknown); its slot is reused once no request uses it."""
        return self.adapters.pop(name, None) is not None

    def names(self) -> list[str]:
        return list(self.adapters)

    def can_seat(self, name: str, slots_in_use: Iterable[int]) -> bool:
        """Whether `acquire` would find adapter `name` a slot now."""
        adapter = self.adapters.get(name)
        if adapter is not None and any(held is adapter for held in self.slots):
            return True
        return len(set(slots_in_use)) < len(self.slots)

    def acquire(self, adapter: LoRAAdapter, slots_in_use: Iterable[int]) -> int:
        """A slot holding `adapter`, written now if it has none; raises NoLoRASlotError."""
        self._clock += 1
        for slot, held in enumerate(self.slots):
            if held is adapter:
                self._last_used[slot] = self._clock
                return slot
        busy = set(slots_in_use)
        free = [s for s in range(len(self.slots)) if s not in busy]
        if not free:
            raise NoLoRASlotError(f"no room for LoRA adapter {adapter.name!r}: all {len(self.slots)} adapter slots "
                                  f"(max_loras) hold adapters that running requests use")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
        self._write_slot(slot, adapter.weights)
        self.slots[slot] = adapter
        self._last_used[slot] = self._clock
        return slot

    def resident(self) -> list[str]:
        """Names of the adapters that hold a slot and are still loaded."""
        return [a.name for a in self.slots if a is not None and self.adapters.get(a.name) is a]
