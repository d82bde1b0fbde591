"""Greedy completion of one prompt by stock llama.cpp (llama-cpp-python) in a fresh process: whether a
GGUF we wrote still loads in llama.cpp, and what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = ("import sys; from llama_cpp import Llama\n"
           "m = Llama(sys.argv[1], n_ctx=128, n_threads=1, verbose=False)\n"
           "print(repr(m.create_completion('The capital of France is', max_tokens=6, temperature=0)"
           "['choices'][0]['text']))")


def stock_completion(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
