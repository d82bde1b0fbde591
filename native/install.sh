#!/usr/bin/env bash
# Installs sekv-local into ./.venv (or $SEKV_VENV) with everything it needs, offline-safe:
#   torch (CPU wheel unless a torch is already importable, e.g. a CUDA build the user installed),
#   llama-cpp-python built WITHOUT AMX (the native default enables AMX on some Xeons and then
#   segfaults in the first llama_decode), cached by a hash of its build inputs,
#   then sekv-local itself (editable) with its extras.
# Usage: bash native/install.sh [--dev]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${SEKV_VENV:-$here/.venv}"
extras="."
[[ "${1:-}" == "--dev" ]] && extras=".[dev]"

LLAMA_CPP_PYTHON_VERSION="0.3.36"
TORCH_CPU_VERSION="2.13.0"
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/sekv-local"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "[install] creating virtualenv $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  echo "[install] torch $TORCH_CPU_VERSION (CPU build)"
  pip install "torch==$TORCH_CPU_VERSION"
fi

if ! "$py" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$LLAMA_CPP_PYTHON_VERSION' else 1)" 2>/dev/null; then
  key=$(printf '%s|%s|%s|%s' "$LLAMA_CPP_PYTHON_VERSION" "$CMAKE_FLAGS" "$("$py" -c 'import sys;print(sys.version)')" "$(uname -m)" | sha256sum | cut -c1-16)
  wheel_dir="$cache_root/wheels/llama-cpp-python-$key"
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "[install] building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION without AMX (takes ~5 min on 2 cores; cached in $wheel_dir)"
    mkdir -p "$wheel_dir.tmp"
    # --no-cache-dir: pip's own wheel cache ignores CMAKE_ARGS and could hand back a native (AMX) build.
    CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$py" -m pip wheel -q --no-cache-dir --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$wheel_dir.tmp"
    rm -rf "$wheel_dir"; mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  pip install "$wheel_dir"/llama_cpp_python-*.whl
fi

if ! command -v cmake >/dev/null 2>&1 && [[ ! -x "$venv/bin/cmake" ]]; then
  echo "[install] cmake and ninja (to build the native engine)"
  pip install cmake ninja
fi

echo "[install] sekv-local $extras"
(cd "$here" && pip install -e "$extras")
echo "[install] done: $venv/bin/sekv-local"
