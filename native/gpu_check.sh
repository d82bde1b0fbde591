#!/usr/bin/env bash
# The native engine's GPU check (issue 6): build with CUDA, parity of the GPU path against the CPU path,
# decode tokens/s of SeKV vs stock llama.cpp at 8K/32K/128K. The GPU machine reaches no network and takes
# at most 64 MiB of files, so this runs in two halves:
#
#   here:        bash native/gpu_check.sh prepare
#                (copies the patched llama.cpp tree, trimmed to what the build needs, into .gpu/, which
#                 git ignores; prints its size)
#   GPU machine: the device tool's run with carry [".gpu"] and the command
#                bash native/gpu_check.sh run
#                (prints everything; files land in $OUT)
#
# Nothing else is fetched there: numpy and nvcc/cmake/ninja/cuBLAS are on that machine, gguf comes from
# the carried tree's gguf-py, and the model is a synthetic GGUF of SmolLM2-135M's shape (random weights;
# sekv_local/native/synthetic_model.py), enough for engine-against-engine parity and speed.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"

case "${1:-}" in
  prepare)
    py="${SEKV_PYTHON:-$here/.venv/bin/python}"
    tree=$("$py" -c 'from sekv_local.native import build
print(build.source_tree(build.BuildPlan.create(), print))' | tail -1)
    rm -rf .gpu/llama.cpp && mkdir -p .gpu/llama.cpp
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    for part in CMakeLists.txt cmake ggml src include gguf-py common vendor licenses LICENSE; do
      [[ -e "$tree/$part" ]] && cp -r "$tree/$part" .gpu/llama.cpp/
    done
    # what the build never reads: other backends' sources, docs and tests
    for backend in .gpu/llama.cpp/ggml/src/ggml-*/; do
      case "$(basename "$backend")" in ggml-cpu|ggml-cuda) ;; *) rm -rf "$backend" ;; esac
    done
    touch .gpu/llama.cpp/.sekv-ready
    du -sh .gpu
    echo "now: device run with carry [\".gpu\"] and command: bash native/gpu_check.sh run"
    ;;
  run)
    [[ -d .gpu/llama.cpp ]] || { echo "no .gpu/llama.cpp: run 'bash native/gpu_check.sh prepare' first (and carry .gpu)"; exit 2; }
    out="${OUT:-$here/runs/gpu_check}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    export SEKV_LLAMA_CPP_DIR="$here/.gpu/llama.cpp" PYTHONPATH="$here:$here/.gpu/llama.cpp/gguf-py" PYTHONUNBUFFERED=1
    export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/tmp/sekv-cache}"
    set -o pipefail
    python3 -m sekv_local.native.gpu_check --device cuda --contexts "${CONTEXTS:-8k,32k,128k}" \
      --threads "${THREADS:-8}" --out "$out" 2>&1 | tee "$out/gpu_check.log"
    ;;
  *)
    echo "usage: bash native/gpu_check.sh prepare | run"; exit 2 ;;
esac
