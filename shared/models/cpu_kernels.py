"""The C++ CPU kernels a model runs on, loaded before its weights and announced.

Loading them is instant: the install compiled them for each CPU level (kernels/cpu_build.py). Where those
cannot serve, they are compiled here on a first start, which takes a minute or two. Loaded lazily, that
would happen without a word in the middle of loading the weights (the linear layers pack their weights
for their kernel), hence this step of its own.
"""
from __future__ import annotations

import logging
import time

import torch

from epdserve.kernels import cpu_attention, cpu_layer_ops, cpu_linear

logger = logging.getLogger(__name__)


def load_cpu_kernels(dtype: torch.dtype, layer_ops: bool, attention: bool) -> None:
    """Load (building them if they are not yet) the linear-layer kernel for `dtype`, the layer ops (RMSNorm,
    RoPE, SiLU-and-multiply) if `layer_ops`, the paged attention kernel if `attention`. Where one cannot be
    built, its callers keep the PyTorch path, as they would anyway."""
    logger.info("C++ CPU kernels: loading them (prebuilt at install; where those cannot serve, compiled here on "
                "a first start: about half a minute per kernel, once)")
    started = time.monotonic()
    cpu_linear.supports(dtype)
    if layer_ops:
        cpu_layer_ops.available()
    if attention:
        cpu_attention.available()
    logger.info("C++ CPU kernels ready in %.1fs", time.monotonic() - started)
