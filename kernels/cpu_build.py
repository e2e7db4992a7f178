"""Builds the C++ CPU kernels of csrc/ on first use, for the CPU they run on.

torch's cpp_extension compiles a source with g++ and ninja (about a minute, once) and caches the result
under ~/.cache/torch_extensions; `-march=native` makes it fast here and wrong elsewhere, so each kind of
CPU (its feature flags) gets its own build, as does each checkout. Where a kernel cannot be built (no
compiler), `load` returns None and its callers keep the PyTorch path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
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
    from torch.utils.cpp_extension import load as build

    # One build per CPU kind, per checkout and per version of the shared headers: torch rebuilds whenever a
    # build's source path or source changes, so two checkouts sharing one name would rebuild each other's
    # kernels on every start, but it does not look at the headers a source includes.
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    tag = hashlib.blake2b(f"{_cpu_flags()}\n{CSRC.resolve()}\n".encode() + headers, digest_size=4).hexdigest()
    try:
        return build(name=f"epdserve_{Path(source).stem}_{tag}", sources=[str(CSRC / source)],
                     extra_cflags=["-O3", "-march=native", "-fopenmp"] + (["-ffp-contract=off"] if exact_rounding else []),
                     verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform
        logger.warning("the C++ kernel %s cannot be built (%s); using the PyTorch path", source, exc)
        return None
