"""Engine names on the command line -> engine objects."""

from __future__ import annotations

from pathlib import Path

from ..errors import SekvError
from ..models.tokenizer import Tokenizer
from .base import Engine, EngineOptions

ENGINES = ("torch", "llama.cpp", "llama.cpp-stock")


def create_engine(name: str, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> Engine:
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(gguf_path, tokenizer, options)
    if name == "llama.cpp":
        from .llama_cpp_sekv import LlamaCppSekvEngine

        return LlamaCppSekvEngine(gguf_path, tokenizer, options)
    if name == "llama.cpp-stock":
        from .llama_cpp_stock import LlamaCppStockEngine

        return LlamaCppStockEngine(gguf_path, tokenizer, options)
    raise SekvError(f"unknown engine '{name}' (available: {', '.join(ENGINES)})")
