"""What epdserve serves: a local HF model folder, checked before any process starts loading it.

A model folder holds `config.json` (a supported architecture), `*.safetensors` weights, a tokenizer
(`tokenizer.json` or `tokenizer_config.json`) and, for a LLaVA or Qwen2.5-VL checkpoint, its image
processor's settings. epdserve downloads nothing: a hub id such as `org/name` is refused with the way to fetch it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

# `org/name` as the Hugging Face hub spells repositories; a path a user means as local rarely looks so.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
PREPARE_HINT = "`epdserve model llava-demo` or `epdserve model smollm2` prepares one offline"


def check_model_folder(path: str | Path) -> Path:
    """The folder, if it has everything a stack needs; else FileNotFoundError or ValueError in one line."""
    from epdserve.shared.config import ModelConfig
    from epdserve.shared.processing.multimodal import load_image_processor
    from epdserve.shared.models.weights import safetensors_files

    text = str(path)
    folder = Path(path).expanduser()
    if not folder.exists():
        if _HUB_ID.fullmatch(text):
            name = text.split("/")[1]
            raise FileNotFoundError(
                f"{text!r} is not a folder here; epdserve serves local model folders and downloads nothing: "
                f"fetch it first (`hf download {text} --local-dir ~/models/{name}`) and pass that folder")
        raise FileNotFoundError(f"no model folder at {text!r} ({PREPARE_HINT})")
    if folder.is_file() and folder.suffix == ".gguf":
        from epdserve.shared.checkpoints.packaged_gguf import prepare_gguf

        folder = prepare_gguf(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{text!r} is a file; give the HF model folder that holds config.json, or a "
                                "GGUF file")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{text!r} has no config.json: not an HF model folder ({PREPARE_HINT})")
    try:
        raw = json.loads((folder / "config.json").read_text())
        ModelConfig.from_pretrained(folder)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{text}/config.json is not valid JSON: {exc}") from None
    except KeyError as exc:
        raise ValueError(f"{text}/config.json lacks the setting {exc}") from None
    safetensors_files(folder)  # raises, naming the folder, when weights or shards are missing
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"{text!r} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if "vision_config" in raw:
        load_image_processor(folder)  # raises when the image processor's settings are missing
    return folder


@contextlib.contextmanager
def building(folder: Path) -> Iterator[None]:
    """Holds a lock beside `folder` while it is built into the cache: processes that start together (a stack's
    services, parallel test workers) build it once, and never replace the folder another one already serves."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f".{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """`folder`, written by build(folder) unless a checkpoint (config.json) is already there: builders with a
    fixed seed write the same checkpoint every time, so one built before is reused."""
    with building(folder):
        if not (folder / "config.json").is_file():
            build(folder)
    return folder


def write_whole(out: Path, build: Callable[[Path], object]) -> Path:
    """`out`, written by build(a new folder beside it) and then put in its place, replacing a folder already
    there: never left half-written, whatever stops the build."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
