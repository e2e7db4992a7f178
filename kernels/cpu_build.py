"""Builds the C++ CPU kernels of csrc/ on first use, for the CPU they run on.

torch's cpp_extension compiles a source with g++ and ninja (about a minute, once) and caches the result
under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR); `-march=native` makes it fast here and wrong
elsewhere, so each kind of CPU (its feature flags) gets its own build, as does each checkout. Where a
kernel cannot be built (no compiler), `load` returns None and its callers keep the PyTorch path.

Processes that start together (replicas sharing one cache volume) take turns through an flock on the
build's folder. torch's own turn-taking is a `lock` file that a builder killed mid-build (OOM, a container
stopped while it starts) leaves behind, and every later process waits on it forever; the kernel drops an
flock with the process that held it, and whoever holds ours knows such a `lock` file is stale.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


@functools.cache
def load(source: str, exact_rounding: bool = False):
    """The extension module built from csrc/`source`, or None if it cannot be built here. With
    `exact_rounding`, a*b + c*d stays two roundings (no fused multiply-add), as PyTorch's separate ops do."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    from torch.utils.cpp_extension import load as build

    # One build per CPU kind, per checkout, per version of the shared headers and per torch and Python:
    # torch rebuilds whenever a build's source path or source changes, so two checkouts sharing one name
    # would rebuild each other's kernels on every start, but it does not look at the headers a source
    # includes.
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    key = f"{_cpu_flags()}\n{CSRC.resolve()}\n{torch.__version__}\n{sys.version}\n".encode() + headers
    name = f"epdserve_{Path(source).stem}_{hashlib.blake2b(key, digest_size=4).hexdigest()}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "epdserve.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)  # torch's, stale: no builder runs while we hold ours
            return build(name=name, sources=[str(CSRC / source)], build_directory=str(folder),
                         extra_cflags=["-O3", "-march=native", "-fopenmp"]
                         + (["-ffp-contract=off"] if exact_rounding else []),
                         verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform, a cache we cannot write
        logger.warning("the C++ kernel %s cannot be built (%s); using the PyTorch path", source, exc)
        return None
