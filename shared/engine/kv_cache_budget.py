"""How big an engine's KV pool is: given outright, or sized from the memory the engine can use.

In order of precedence:
    num_blocks              exactly that many blocks
    kv_cache_memory_bytes   as many blocks as fit in that many bytes
    auto                    fraction x (available memory - the model's weights)

Available memory is measured before the weights load: on CPU the tighter of the host's MemAvailable and
the headroom under this process's cgroup memory limit (v2 or v1), on CUDA the device's free memory.
The auto fraction defaults to 0.9 on a GPU (one engine owns it) and to 0.05 on CPU, where a host runs
several engines that each see the same free memory (`epdserve up`, compose) and the engine itself needs
memory beside its pool (activations, the decode mirror, transfer buffers). The auto size never exceeds
what `max_num_seqs` sequences of `max_model_len` tokens need, and is raised to one `max_model_len`
sequence when that takes at most half the spare memory: the scheduler refuses a request whose prompt and
output cannot fit the pool.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from epdserve.shared.config import EngineConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_FRACTION = 0.05
DEFAULT_GPU_FRACTION = 0.9
# A cgroup v1 "no limit" is a page-rounded 2^63 - 1; anything at or above this is no limit.
_NO_LIMIT = 1 << 62


class MemoryLimit(NamedTuple):
    num_bytes: int  # what the engine may still take
    source: str  # where the number comes from: "host MemAvailable", "cgroup v2 memory.max", "cuda:0 free memory"


class KVCacheSize(NamedTuple):
    num_blocks: int
    num_bytes: int
    reason: str  # how the size was chosen, for the start-up log line


def default_fraction(device: str) -> float:
    return DEFAULT_CPU_FRACTION if torch.device(device).type == "cpu" else DEFAULT_GPU_FRACTION


def size_kv_cache(config: EngineConfig, limit: MemoryLimit | None = None) -> KVCacheSize:
    """The pool for `config`; `limit` (measured when None) is read only for the auto size."""
    cache, model = config.cache, config.model
    block_bytes = model.kv_bytes_per_token(config.kv_dtype_name) * cache.block_size
    if cache.num_blocks is not None:
        return KVCacheSize(cache.num_blocks, cache.num_blocks * block_bytes, "num_kv_blocks given")
    if cache.kv_cache_memory_bytes is not None:
        num = cache.kv_cache_memory_bytes // block_bytes
        if num <= 0:
            raise ValueError(f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds no block of this model "
                             f"({block_bytes} bytes a block)")
        return KVCacheSize(num, num * block_bytes, f"kv_cache_memory {_gib(cache.kv_cache_memory_bytes)} given")

    limit = limit if limit is not None else available_memory(config.device)
    fraction = cache.kv_cache_memory_fraction or default_fraction(config.device)
    weights = model.num_weight_bytes
    if config.lora is not None:  # the adapter slots sit beside the weights
        from epdserve.shared.models.lora_adapter import slot_bytes

        weights += slot_bytes(model, config.lora)
    spare = limit.num_bytes - weights
    if spare < block_bytes:
        raise ValueError(f"no memory for a KV cache: {_gib(limit.num_bytes)} available ({limit.source}) and the "
                         f"weights take {_gib(weights)}; give kv_cache_memory or num_kv_blocks")
    blocks_per_seq = -(-model.max_model_len // cache.block_size)
    most = blocks_per_seq * config.scheduler.max_num_seqs
    num = int(spare * fraction) // block_bytes
    reason = (f"auto: {fraction:g} x ({_gib(limit.num_bytes)} available ({limit.source}) - {_gib(weights)} "
              "of weights)")
    if num > most:
        num = most
        reason += f", capped at {config.scheduler.max_num_seqs} sequences of {model.max_model_len} tokens"
    elif num < blocks_per_seq:
        if blocks_per_seq * block_bytes <= spare // 2:
            num = blocks_per_seq
            reason += f", raised to fit one sequence of {model.max_model_len} tokens"
        else:
            reason += f"; too small for a sequence of {model.max_model_len} tokens"
    if num <= 0:
        raise ValueError(f"the KV cache would hold no block ({reason}); give kv_cache_memory or num_kv_blocks")
    return KVCacheSize(num, num * block_bytes, reason)


def available_memory(device: str, root: str | Path = "/") -> MemoryLimit:
    """What this process may still allocate on `device` (files read under `root`, for tests)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return MemoryLimit(free, f"{dev.type}:{dev.index if dev.index is not None else torch.cuda.current_device()} "
                                 "free memory")
    root = Path(root)
    meminfo = _meminfo(root / "proc" / "meminfo")
    best = MemoryLimit(meminfo["MemAvailable"], "host MemAvailable")
    for headroom in _cgroup_headroom(root, meminfo["MemTotal"]):
        if headroom.num_bytes < best.num_bytes:
            best = headroom
    return best


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _cgroup_headroom(root: Path, host_total: int) -> list[MemoryLimit]:
    """limit - usage (reclaimable page cache not counted) for every memory cgroup above this process."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, files = root / "sys" / "fs" / "cgroup", ("memory.max", "memory.current", "inactive_file")
            source = "cgroup v2 memory.max"
        elif "memory" in controllers.split(","):
            base = root / "sys" / "fs" / "cgroup" / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            source = "cgroup v1 memory.limit_in_bytes"
        else:
            continue
        for folder in _ancestors(base, path):
            headroom = _headroom(folder, *files, host_total)
            if headroom is not None:
                found.append(MemoryLimit(headroom, source))
    return found


def _ancestors(base: Path, path: str) -> list[Path]:
    """The cgroup's folder and those above it, up to the mount point. Inside a cgroup namespace the
    path may not exist under the mount (the mount is the namespace's root): then the mount alone."""
    folder = base / path.strip("/")
    if not folder.is_dir():
        return [base]
    chain = [folder]
    while folder != base:
        folder = folder.parent
        chain.append(folder)
    return chain


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str, host_total: int) -> int | None:
    try:
        raw = (folder / limit_file).read_text().strip()
        if raw == "max":
            return None
        limit = int(raw)
        if limit >= min(_NO_LIMIT, host_total):
            return None
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(limit - max(usage - inactive, 0), 0)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
