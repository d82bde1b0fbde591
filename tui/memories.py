"""Where the app keeps saved document memories, and how it finds one for a document and model.

A memory is named ``<document sha256[:16]>-<model>-<engine>-<method>[-<budget>].sekv`` inside the
memories folder (``$SEKV_LOCAL_CACHE/memories``, else ``<user cache dir>/sekv-local/memories``),
so the memory of the same file (by content) and model is found again whatever the file's path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIX = ".sekv"


def default_dir() -> Path:
    """The memories folder next to the models cache."""
    root = os.environ.get("SEKV_LOCAL_CACHE")
    if root:
        return Path(root) / "memories"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("sekv-local")) / "memories"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def model_slug(model: str) -> str:
    """A file-name-safe model name: the GGUF file's stem (so a registry name and the path of the
    same cached file give the same name)."""
    from sekv_local.models import registry

    path: Path | None = None
    if model in registry.REGISTRY:
        path = registry.cached_path(model)
    else:
        path = Path(model).expanduser()
    return _slug(path.stem if path.suffix.lower() == ".gguf" else path.name)


def budget_tag(budget: float | int | None) -> str:
    if budget is None:
        return ""
    if isinstance(budget, float) and budget <= 1:
        return f"-b{budget:g}"
    return f"-b{int(budget)}B"


def memory_path(folder: Path, doc_sha: str, model: str, engine: str, method: str,
                budget: float | int | None) -> Path:
    """The memory file for exactly these settings."""
    name = f"{doc_sha[:16]}-{model_slug(model)}-{_slug(engine)}-{_slug(method)}{budget_tag(budget)}{SUFFIX}"
    return Path(folder) / name


@dataclass(frozen=True)
class SavedMemory:
    path: Path
    method: str
    budget: Any
    engine: str
    size: int
    mtime: float

    def describe(self) -> str:
        budget = "" if self.budget is None else f", budget {format_budget(self.budget)}"
        return f"{self.path.name} (method {self.method}{budget}, {format_bytes(self.size)})"


def find_memories(folder: Path, doc_sha: str, model: str) -> list[SavedMemory]:
    """Readable memories of this document built with this model, newest first."""
    from sekv_local.persistence import read_header

    folder = Path(folder)
    if not folder.is_dir():
        return []
    prefix = f"{doc_sha[:16]}-{model_slug(model)}-"
    found = []
    for path in folder.glob(f"{prefix}*{SUFFIX}"):
        try:
            header = read_header(path)
            st = path.stat()
        except Exception:  # a damaged file is simply not offered
            continue
        if header.get("document", {}).get("sha256") != doc_sha:
            continue
        found.append(SavedMemory(path, header.get("method", "?"), header.get("budget"), header.get("engine", "?"),
                                 st.st_size, st.st_mtime))
    return sorted(found, key=lambda m: -m.mtime)


def format_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_budget(budget: float | int | None) -> str:
    if budget is None:
        return "none"
    if isinstance(budget, float) and budget <= 1:
        return f"{budget:.0%}" if round(budget * 100) == budget * 100 else f"{budget * 100:g}%"
    return format_bytes(budget)
