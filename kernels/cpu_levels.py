"""The C++ CPU kernels and the CPU levels they are built for ahead of time, and the level a CPU runs.

setup.py builds every source of csrc/ once per level of the build machine's architecture, into
prebuilt/ (module `<source>_<level>`); at run time the best level whose instructions the CPU has is
chosen from its /proc/cpuinfo flags. setup.py loads this file by its path, before the package is
installed: it imports nothing from epdserve, nor torch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"
# What setup.py writes beside the prebuilt modules: the torch and the sources they were built from.
MANIFEST = "manifest.json"

# Each source's own flags. cpu_layer_ops rounds where PyTorch's separate ops do: a*b + c*d stays two
# roundings, never a fused multiply-add; so does cpu_linear's unpacking of a quantized weight into a buffer
# (scale * q + offset, as the reference dequantizer rounds it; its tiles fuse only where that rounds alike).
SOURCES = {
    "cpu_paged_attention": (),
    "cpu_linear": ("-ffp-contract=off",),
    "cpu_layer_ops": ("-ffp-contract=off",),
}
COMMON_CFLAGS = ("-O3", "-fopenmp")

# /proc/cpuinfo's names for what -march=x86-64-v2/v3/v4 let the compiler emit (lzcnt is `abm`).
_X86_64_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


class Level(NamedTuple):
    name: str
    machine: str  # platform.machine() of the CPUs it runs on
    cpu_flags: frozenset[str]  # what the CPU must have
    cflags: tuple[str, ...]
    description: str


# Best first. The kernels have AVX-512 (and AVX-512 BF16: bfloat16 linear layers) and AVX2 + FMA paths;
# a CPU with AVX-512 but no BF16 runs the AVX2 level. -mtune=znver3 is what GCC 12's -march=native picks
# on Zen 4 (it knows no znver4): with it the kernels run as fast as with -march=native there, with generic
# tuning float32 attention 5% slower. AVX2 CPUs are of many kinds: generic.
LEVELS = (
    Level("avx512_bf16", "x86_64", frozenset(_X86_64_V4 | {"avx512_bf16"}),
          ("-march=x86-64-v4", "-mavx512bf16", "-mtune=znver3"), "x86-64-v4 + AVX-512 BF16"),
    Level("avx2", "x86_64", frozenset(_X86_64_V3), ("-march=x86-64-v3", "-mtune=generic"), "x86-64-v3, AVX2"),
)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (those of its first core), empty where /proc/cpuinfo has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def level_for(flags: frozenset[str], machine: str) -> Level | None:
    """The best level a CPU with these flags runs, or None."""
    return next((level for level in LEVELS if level.machine == machine and level.cpu_flags <= flags), None)


def module_name(source: str, level: Level) -> str:
    return f"{source}_{level.name}"


def sources_digest() -> str:
    """Changes whenever a source or header of csrc/ does: prebuilt modules older than the sources are stale."""
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
