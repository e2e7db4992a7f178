"""The attention backend: the one interface through which the engine writes and reads the paged KV cache.

Three implementations share the signatures of `epdserve.kernels.torch_attention`:
    "torch"  plain PyTorch, torch_attention (also runs on CUDA, and serves CPUs where "cpu" cannot be built)
    "cpu"    decodes and prefill chunks by a C++ kernel straight from the paged cache (CPU only)
    "triton" the Triton kernels (CUDA; on CPU only under the Triton interpreter, for tests)
Triton is imported only when the Triton backend is chosen, so this module imports without it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from epdserve.kernels import cpu_attention, torch_attention

BACKEND_NAMES = ("auto", "triton", "cpu", "torch")


class AttentionBackend(NamedTuple):
    """Which implementation runs, and its entry points (torch_attention's signatures)."""

    name: str  # "triton", "cpu" or "torch", never "auto"
    write_kv: Callable[..., None]  # kv_cache_write(key, value, key_cache, value_cache, slot_mapping)
    attend: Callable[..., torch.Tensor]  # paged_attention(query, key_cache, ..., scale, sliding_window, out)
    # plan_attention(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, sliding_window):
    # per-step work shared by all layers of that window, passed to `attend` as plan=...; None when there is
    # none. With base= (the same step's plan for another window) it reuses what does not depend on the window.
    plan: Callable[..., object] | None = None


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Return the backend called `name` for tensors on `device`.

    "auto" is Triton on CUDA, "cpu" on a CPU where its kernel builds, else "torch".
    "triton" on a non-CUDA device is allowed only when Triton's interpreter is on (TRITON_INTERPRET=1
    before triton is first imported). Raises ValueError for an unknown name and RuntimeError when the
    backend cannot serve the device.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" and cpu_attention.available() \
            else "torch"
    if name == "torch":
        return AttentionBackend("torch", torch_attention.kv_cache_write, torch_attention.paged_attention,
                                torch_attention.plan_attention)
    if name == "cpu":
        if device.type != "cpu" or not cpu_attention.available():
            raise RuntimeError(f"the cpu attention backend needs a CPU device and its C++ kernel built, got {device}")
        return AttentionBackend("cpu", cpu_attention.kv_cache_write, cpu_attention.paged_attention,
                                cpu_attention.plan_attention)
    return _triton_backend(device)


def _triton_backend(device: torch.device) -> AttentionBackend:
    try:
        from epdserve.kernels.kv_cache_write import kv_cache_write
        from epdserve.kernels.paged_attention import INTERPRETED, paged_attention
    except ImportError as exc:
        raise RuntimeError(f"the triton attention backend needs the triton package: {exc}") from exc
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device, got {device}; on CPU it runs only under "
            "the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), else use 'torch'"
        )
    return AttentionBackend("triton", kv_cache_write, paged_attention)
