"""`--engine auto`: which engine runs, and the reason it gives when it is not the llama.cpp engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sekv_local.engines.base import EngineOptions
from sekv_local.engines.choice import EngineChoice, choose_engine
from sekv_local.models import registry


def sekv(**options) -> EngineOptions:
    return EngineOptions(method="sekv", method_options=options)


def test_an_engine_named_is_the_engine_run(model_path) -> None:
    for name in ("torch", "llama.cpp", "llama.cpp-stock"):
        assert choose_engine(name, model_path, EngineOptions(method="full")).name == name
        assert choose_engine(name, model_path, EngineOptions(method="full")).notice() is None


def test_auto_runs_sekv_on_a_llama_model_in_the_llama_cpp_engine(model_path) -> None:
    choice = choose_engine("auto", model_path, sekv())
    assert (choice.name, choice.reason) == ("llama.cpp", None)  # the install builds the native library


@pytest.mark.parametrize("options, why", [
    (EngineOptions(method="full"), "method 'full' runs in the torch engine"),
    (EngineOptions(method="streaming"), "method 'streaming' runs in the torch engine"),
    (sekv(positions="bounded"), "does not run positions=bounded"),
])
def test_auto_falls_back_to_torch_and_says_why(options, why, model_path) -> None:
    choice = choose_engine("auto", model_path, options)
    assert choice.name == "torch" and why in choice.notice() and choice.notice().startswith("engine torch: ")


def test_auto_without_the_native_library_says_how_to_build_it(model_path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEKV_NATIVE_LIBRARY", str(tmp_path / "missing.so"))
    choice = choose_engine("auto", model_path, sekv())
    assert choice.name == "torch" and "native library is not built" in choice.reason
    assert "native/install.sh" in choice.reason


def test_auto_runs_gemma3_in_the_llama_cpp_engine_within_its_trained_context() -> None:
    gemma = registry.resolve_model("gemma3-270m", show_progress=False)
    assert choose_engine("auto", gemma, sekv()) == EngineChoice("llama.cpp")
    bounded = choose_engine("auto", gemma, sekv(positions="bounded"))
    assert bounded.name == "torch" and "positions=bounded" in bounded.reason
