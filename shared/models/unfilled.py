"""Modules built with their parameters left unfilled, for a loader that writes every one of them.

nn.Linear, nn.Embedding and the norms fill their parameters with random (or constant) values when built;
every model here loads through weight_loader.load_weights, which writes each parameter and refuses a
checkpoint that lacks one, so that filling is thrown away: on SmolLM2-135M it costs a third of an engine's
start (0.65 of 1.8 s). Buffers computed in __init__ (RoPE tables) are kept: only torch.nn.init's
in-place fills are skipped while the module is built.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, TypeVar

import torch
from torch.nn import init

M = TypeVar("M", bound=torch.nn.Module)

# The fills nn.Module constructors call (torch.nn.init's in-place functions).
_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_lock = threading.Lock()  # the fills are module attributes: one build at a time replaces them


@contextlib.contextmanager
def _fills_skipped() -> Iterator[None]:
    with _lock:
        saved = {name: getattr(init, name) for name in _FILLS}
        for name in _FILLS:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fill in saved.items():
                setattr(init, name, fill)


def build_unfilled(factory: Callable[[], M], dtype: torch.dtype, device: str | torch.device) -> M:
    """factory() run with `dtype` as the default dtype, on `device`, its parameters left unfilled."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _fills_skipped():
            return factory()
    finally:
        torch.set_default_dtype(default_dtype)
