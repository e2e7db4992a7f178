"""The LoRA adapters the API offers as models: name -> PEFT folder, from --lora-modules and, when runtime
updates are on, `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (vLLM's routes and bodies).

A runtime load takes a name that is a model name, never a path (lora_roots.py), and a folder inside one of
the --lora-root folders (none given: no runtime loads); the engines resolve it, links and all, against their
own roots and read it within their size limit. A refusal does not tell whether a path outside exists.

A request whose `model` is an adapter's name runs with that adapter: its name and folder travel with it on
the wire, and every engine that computes its KV (prefill, decode, unified) applies the same one. A load is
sent to every engine instance, which reads and checks the adapter then: an adapter none can serve (another
base model's, a rank over --max-lora-rank, a corrupt file) is refused with their reason and never listed.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from epdserve.shared.models.lora_roots import LoRARoots, check_adapter_name, outside_message
from epdserve.transport.channel.protocol import LoadLoRA, Message, UnloadLoRA, WireLoRA

logger = logging.getLogger(__name__)

# Sends a message to every engine instance: (instance, error message or None) for each.
FanOut = Callable[[Message], Awaitable[list[tuple[str, str | None]]]]


def parse_lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH ... -> ((name, path), ...); raises ValueError naming a malformed one."""
    modules = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {value!r}: give NAME=PATH (a PEFT adapter folder)")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: names must be distinct, got {names}")
    return tuple(modules)


class LoRAUpdateError(Exception):
    def __init__(self, message: str, status: int, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param  # the body's field at fault


class LoRAModules:
    """Owns the adapters offered; `fan_out` reaches the engines (bound once the backend exists)."""

    def __init__(self, base_model: str, modules: tuple[tuple[str, str], ...] = (),
                 runtime_updates: bool = False, roots: tuple[str, ...] = ()) -> None:
        self.base_model = base_model
        self.paths: dict[str, str] = dict(modules)
        self.runtime_updates = runtime_updates
        self.roots = LoRARoots(roots, must_exist=False)
        self.fan_out: FanOut | None = None
        self._lock = asyncio.Lock()  # one load or unload at a time: each is a round over every engine

    def get(self, name: str) -> WireLoRA | None:
        path = self.paths.get(name)
        return None if path is None else WireLoRA(name, path)

    async def load(self, name: str, path: str) -> str:
        """Have every engine read the adapter; offered once all could. Raises LoRAUpdateError."""
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise LoRAUpdateError(str(exc), 400, "lora_name") from None
        if name == self.base_model:
            raise LoRAUpdateError(f"{name!r} is the base model's name", 400, "lora_name")
        if not self.roots:
            raise LoRAUpdateError("this server loads no adapters at run time from a lora_path: start it with "
                                  "--lora-root DIR, the folders they may come from", 400, "lora_path")
        if not self.roots.lexically_inside(path):
            raise LoRAUpdateError(outside_message(path), 400, "lora_path")
        async with self._lock:
            if name in self.paths:
                raise LoRAUpdateError(f"The lora adapter '{name}' has already been loaded.", 400)
            failures = [f"{where}: {error}" for where, error in await self.fan_out(LoadLoRA(name, path)) if error]
            if failures:
                await self.fan_out(UnloadLoRA(name))  # those that read it forget it again
                raise LoRAUpdateError(f"cannot load LoRA adapter {name!r}: {'; '.join(failures)}", 400, "lora_path")
            self.paths[name] = path
        logger.info("LoRA adapter %s loaded from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        async with self._lock:
            if name not in self.paths:
                raise LoRAUpdateError(f"The lora adapter '{name}' cannot be found.", 404)
            del self.paths[name]  # new requests may not name it; those running finish with it
            await self.fan_out(UnloadLoRA(name))
        logger.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
