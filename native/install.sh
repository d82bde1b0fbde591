#!/usr/bin/env bash
# Installs sekv-local into ./.venv (or $SEKV_VENV) with everything it needs, offline-safe:
#   torch (CPU wheel unless a torch is already importable, e.g. a CUDA build the user installed),
#   llama-cpp-python built for this CPU's instruction sets but WITHOUT AMX (the native default enables
#   AMX on some Xeons and then segfaults in the first llama_decode; forced AVX-512 dies with "Illegal
#   instruction" on CPUs without it), cached by a hash of its build inputs,
#   then sekv-local itself (editable) with its extras.
# Usage: bash native/install.sh [--dev]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${SEKV_VENV:-$here/.venv}"
extras="."
[[ "${1:-}" == "--dev" ]] && extras=".[dev]"

LLAMA_CPP_PYTHON_VERSION="0.3.36"
TORCH_CPU_VERSION="2.13.0"
# one definition of the CPU flags for this wheel and the native engine (stdlib only: runs before install)
CMAKE_FLAGS="$(python3 "$here/sekv_local/native/cpu_flags.py")"

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

key=$(printf '%s|%s|%s|%s' "$LLAMA_CPP_PYTHON_VERSION" "$CMAKE_FLAGS" "$("$py" -c 'import sys;print(sys.version)')" "$(uname -m)" | sha256sum | cut -c1-16)
# the venv remembers which build it holds: a venv moved to another CPU gets the build for that one
build_marker="$venv/.sekv-llama-cpp-build"
if [[ "$(cat "$build_marker" 2>/dev/null)" != "$key" ]] || \
   ! "$py" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$LLAMA_CPP_PYTHON_VERSION' else 1)" 2>/dev/null; then
  wheel_dir="$cache_root/wheels/llama-cpp-python-$key"
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "[install] building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for this CPU ($CMAKE_FLAGS) (takes ~5 min on 2 cores; cached in $wheel_dir)"
    mkdir -p "$wheel_dir.tmp"
    # --no-cache-dir: pip's own wheel cache ignores CMAKE_ARGS and could hand back a native (AMX) build.
    CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$py" -m pip wheel -q --no-cache-dir --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$wheel_dir.tmp"
    rm -rf "$wheel_dir"; mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  "$py" -m pip uninstall -q -y llama-cpp-python >/dev/null 2>&1 || true
  pip install "$wheel_dir"/llama_cpp_python-*.whl
  echo "$key" > "$build_marker"
fi

if ! command -v cmake >/dev/null 2>&1 && [[ ! -x "$venv/bin/cmake" ]]; then
  echo "[install] cmake and ninja (to build the native engine)"
  pip install cmake ninja
fi

echo "[install] sekv-local $extras"
(cd "$here" && pip install -e "$extras")
# The llama.cpp engine (the default for `ask` and `chat`): built now, not on a user's first question. It is
# llama.cpp from the same pinned source and CPU flags as the wheel above, compiled with our sources against
# its internal headers (cached by a hash of its inputs). Without it sekv-local runs the torch engine and says so.
echo "[install] the llama.cpp engine's native library (a few minutes the first time; cached)"
if ! "$venv/bin/sekv-local" native build >/dev/null; then
  echo "[install] the native library did not build (above); sekv-local will run the torch engine" >&2
fi
echo "[install] done: $venv/bin/sekv-local"
