"""Engine names on the command line -> engine objects."""

from __future__ import annotations

from pathlib import Path

from ..errors import SekvError
from ..models.tokenizer import Tokenizer
from .base import Engine, EngineOptions
from .choice import AUTO, EngineChoice, choose_engine

ENGINES = (AUTO, "torch", "llama.cpp", "llama.cpp-stock")


def create_engine(name: str, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> Engine:
    """The engine `name` on this model; `auto` (choice.py) falls back to the torch engine, saying why, when
    the llama.cpp engine cannot run the method or model or does not start."""
    choice = choose_engine(name, gguf_path, options)
    if name == AUTO and choice.name == "llama.cpp":
        try:
            return _create(choice.name, gguf_path, tokenizer, options)
        except SekvError as exc:
            choice = EngineChoice("torch", f"the llama.cpp engine did not start ({exc})")
    engine = _create(choice.name, gguf_path, tokenizer, options)
    if choice.notice() is not None:
        engine.notices.insert(0, choice.notice())
    return engine


def _create(name: str, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> Engine:
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
