"""Loads the C++ CPU kernels of csrc/: prebuilt for this CPU's level, else built here on first use.

The install builds every kernel for each CPU level of cpu_levels (setup.py), against the torch it
installs with; a process loads those of the best level its CPU runs. Where none can serve (a CPU below
every level, an install made without torch, a torch other than the one they were built against, sources
edited since), torch's cpp_extension compiles them here with `-march=native` (with g++ and ninja: about
half a minute per kernel, once) and caches the result under ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR), one build per kind of CPU (its feature flags) and per checkout. Where a kernel
cannot be built either (no compiler), `load` returns None and its callers keep the PyTorch path.

Processes that start together (replicas sharing one cache volume) take turns through an flock on the
build's folder. torch's own turn-taking is a `lock` file that a builder killed mid-build (OOM, a container
stopped while it starts) leaves behind, and every later process waits on it forever; the kernel drops an
flock with the process that held it, and whoever holds ours knows such a `lock` file is stale.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import sys
from pathlib import Path

from epdserve.kernels import cpu_levels
from epdserve.kernels.cpu_levels import CSRC, PREBUILT

logger = logging.getLogger(__name__)


def choose(flags: frozenset[str], machine: str, folder: Path = PREBUILT) -> cpu_levels.Level | None:
    """The level whose prebuilt kernels a CPU with these flags runs, or None: built here. Logs which, and why."""
    level = cpu_levels.level_for(flags, machine)
    problem = _unusable(level, folder)
    if problem is None:
        logger.info("C++ CPU kernels: prebuilt for %s (%s)", level.name, level.description)
        return level
    logger.warning("C++ CPU kernels: built here for this CPU (-march=native) because %s; the first build takes "
                   "about half a minute per kernel, later starts load it from the cache", problem)
    return None


def _unusable(level: cpu_levels.Level | None, folder: Path) -> str | None:
    """Why the prebuilt kernels cannot serve, or None."""
    import torch

    if level is None:
        return (f"this CPU has none of the prebuilt levels "
                f"({'; '.join(f'{lv.name}: {lv.machine} {lv.description}' for lv in cpu_levels.LEVELS)})")
    try:
        manifest = json.loads((folder / cpu_levels.MANIFEST).read_text())
    except (OSError, ValueError):
        return (f"this install has no prebuilt kernels ({folder / cpu_levels.MANIFEST} is missing: it was made "
                "without torch, or with build isolation)")
    if manifest["torch"] != torch.__version__:
        return f"the prebuilt kernels were built against torch {manifest['torch']}, this is torch {torch.__version__}"
    if manifest["sources"] != cpu_levels.sources_digest():
        return f"{CSRC} changed since the prebuilt kernels were built"
    missing = [source for source in cpu_levels.SOURCES if _prebuilt_file(folder, source, level) is None]
    if missing:
        return f"the prebuilt {level.name} kernels {', '.join(missing)} are missing from {folder}"
    return None


@functools.cache
def _level() -> cpu_levels.Level | None:
    return choose(cpu_levels.cpu_flags(), platform.machine())


def _prebuilt_file(folder: Path, source: str, level: cpu_levels.Level) -> Path | None:
    name = cpu_levels.module_name(source, level)
    return next((f for suffix in importlib.machinery.EXTENSION_SUFFIXES if (f := folder / (name + suffix)).is_file()),
                None)


@functools.cache
def load(source: str):
    """The extension module of csrc/`source`.cpp, or None if it cannot be built here."""
    level = _level()
    return build(source) if level is None else load_prebuilt(source, level)


def load_prebuilt(source: str, level: cpu_levels.Level):
    """The prebuilt module of csrc/`source`.cpp for `level` (whose instructions the CPU must have)."""
    import torch  # noqa: F401 - the module links against the libraries torch loads

    path = _prebuilt_file(PREBUILT, source, level)
    if path is None:
        raise FileNotFoundError(f"no prebuilt {cpu_levels.module_name(source, level)} module in {PREBUILT}")
    spec = importlib.util.spec_from_file_location(f"epdserve.kernels.prebuilt.{path.name.partition('.')[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(source: str):
    """csrc/`source`.cpp built for this CPU (or loaded from the cache of an earlier build), or None."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    from torch.utils.cpp_extension import load as build_extension

    # One build per CPU kind, per checkout, per version of the shared headers and per torch and Python:
    # torch rebuilds whenever a build's source path or source changes, so two checkouts sharing one name
    # would rebuild each other's kernels on every start, but it does not look at the headers a source
    # includes.
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    flags = " ".join(sorted(cpu_levels.cpu_flags()))
    key = f"{flags}\n{CSRC.resolve()}\n{torch.__version__}\n{sys.version}\n".encode() + headers
    name = f"epdserve_{source}_{hashlib.blake2b(key, digest_size=4).hexdigest()}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "epdserve.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)  # torch's, stale: no builder runs while we hold ours
            if not (folder / f"{name}.so").exists():
                logger.warning("building the C++ kernel %s.cpp for this CPU into %s (about half a minute)", source,
                               folder)
            return build_extension(name=name, sources=[str(CSRC / f"{source}.cpp")], build_directory=str(folder),
                                   extra_cflags=[*cpu_levels.COMMON_CFLAGS, "-march=native",
                                                 *cpu_levels.SOURCES[source]],
                                   verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform, a cache we cannot write
        logger.warning("the C++ kernel %s.cpp cannot be built (%s); using the PyTorch path", source, exc)
        return None
