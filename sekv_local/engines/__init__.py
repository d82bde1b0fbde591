"""Inference engines behind one session API: the torch reference engine and llama.cpp."""

from .base import Engine, EngineOptions, EngineStats, SamplingConfig  # noqa: F401
from .factory import ENGINES, create_engine  # noqa: F401
