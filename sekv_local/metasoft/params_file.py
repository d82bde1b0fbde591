"""Trained Meta-Soft parameters as a file (safetensors + JSON metadata), checked like router files.

Everything read is untrusted: dims bounded, tensor names and shapes must be exactly those of a
library with those dims, values finite; defects raise :class:`MetaSoftFileError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import SekvError
from ..models.config import ModelConfig
from ..sekv.router_file import json_object
from .library import SoftTokenLibrary

FORMAT_VERSION = 1
PREFIX = "metasoft."
DIM_KEYS = ("n_embd", "feature_dim", "n_library", "n_soft", "hidden")
_MAX_DIM = 1 << 20
_MAX_VALUES = 1 << 26


class MetaSoftFileError(SekvError):
    """A Meta-Soft parameter file is unusable (corrupt, another version, another model's dims)."""


def dims_of(library: SoftTokenLibrary) -> dict[str, int]:
    return {"n_embd": library.library.shape[1], "feature_dim": library.feature_dim,
            "n_library": library.n_library, "n_soft": library.n_soft, "hidden": library.hidden}


def save_library(path: str | Path, library: SoftTokenLibrary, info: dict[str, Any] | None = None) -> Path:
    """Write the parameters atomically (info: provenance, e.g. model, steps, losses)."""
    from safetensors.torch import save_file

    from ..persistence import atomic_write

    tensors = {name: t.detach().float().cpu().contiguous() for name, t in library.state_dict().items()}
    metadata = {"metasoft.format_version": str(FORMAT_VERSION), "metasoft.dims": json.dumps(dims_of(library)),
                "metasoft.info": json.dumps(info or {})}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def load_library(path: str | Path, config: ModelConfig | None = None) -> tuple[SoftTokenLibrary, dict[str, Any]]:
    """(library, info) from a parameter file; with `config`, refuse another model's dims."""
    from safetensors import SafetensorError, safe_open

    source = str(path)
    if not Path(path).is_file():
        raise MetaSoftFileError(f"Meta-Soft parameter file not found: {path}")
    try:
        with safe_open(source, framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name).float() for name in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise MetaSoftFileError(f"{source} is not a readable Meta-Soft parameter file ({exc})") from None
    if meta.get("metasoft.format_version") != str(FORMAT_VERSION):
        raise MetaSoftFileError(f"{source}: Meta-Soft format version {meta.get('metasoft.format_version')!r} is "
                                f"not supported (this sekv-local reads version {FORMAT_VERSION})")
    dims = json_object(meta.get("metasoft.dims"), "metasoft.dims", source)
    library = _build(dims, tensors, source, config)
    return library, json_object(meta.get("metasoft.info", "{}"), "metasoft.info", source)


def _build(dims: dict[str, Any], tensors: dict[str, torch.Tensor], source: str,
           config: ModelConfig | None) -> SoftTokenLibrary:
    """A frozen library from untrusted dims and tensors (every check here)."""
    _check_dims(dims, source, config)
    library = SoftTokenLibrary(dims["n_embd"], dims["feature_dim"], dims["n_library"], dims["n_soft"], dims["hidden"])
    expected = {name: tuple(t.shape) for name, t in library.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        raise MetaSoftFileError(f"{source}: tensors {got} do not match the dims {dims}")
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise MetaSoftFileError(f"{source}: parameters hold non-finite values")
    library.load_state_dict(tensors)
    library.requires_grad_(False)
    return library


def _check_dims(dims: dict[str, Any], source: str, config: ModelConfig | None) -> None:
    for key in DIM_KEYS:
        value = dims.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_DIM:
            raise MetaSoftFileError(f"{source}: dim '{key}' must be an integer in [1, {_MAX_DIM}], got {value!r}")
    if dims["n_soft"] > dims["n_library"]:
        raise MetaSoftFileError(f"{source}: more soft tokens ({dims['n_soft']}) than library vectors")
    if config is not None:
        feature_ok = dims["feature_dim"] % (config.n_heads * config.head_dim) == 0
        if dims["n_embd"] != config.n_embd or not feature_ok:
            raise MetaSoftFileError(f"{source}: Meta-Soft parameters were trained for another model "
                                    f"(n_embd {dims['n_embd']}, model: {config.n_embd})")
    values = (dims["n_library"] * dims["n_embd"] + dims["n_soft"] * dims["n_library"]
              + dims["hidden"] * (dims["feature_dim"] + 1) + dims["n_soft"] * dims["n_library"] * (dims["hidden"] + 1))
    if values > _MAX_VALUES:
        raise MetaSoftFileError(f"{source}: dims {dims} ask for {values} parameters (more than {_MAX_VALUES})")


# -- GGUF metadata (arrays, not tensors: stock llama.cpp refuses tensors its architecture does not make) --
def gguf_entries(library: SoftTokenLibrary, info: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(key, value, kind) to write into a GGUF; kind "u32", "str" or "f32[]" (flattened, row-major)."""
    entries: list[tuple[str, Any, str]] = [(PREFIX + "format_version", FORMAT_VERSION, "u32")]
    entries += [(PREFIX + key, value, "u32") for key, value in dims_of(library).items()]
    entries.append((PREFIX + "info", json.dumps(info), "str"))
    entries += [(PREFIX + name, t.detach().reshape(-1).float().tolist(), "f32[]")
                for name, t in library.state_dict().items()]
    return entries


def read_gguf_library(metadata: Callable[[str], Any], keys: list[str], source: str,
                      config: ModelConfig | None = None) -> tuple[SoftTokenLibrary, dict[str, Any]] | None:
    """The library in a GGUF's `metasoft.*` metadata, or None when it has none."""
    if not any(k.startswith(PREFIX) for k in keys):
        return None
    if metadata(PREFIX + "format_version") != FORMAT_VERSION:
        raise MetaSoftFileError(f"{source}: Meta-Soft format version {metadata(PREFIX + 'format_version')!r} is "
                                f"not supported (this sekv-local reads version {FORMAT_VERSION})")
    dims = {key: metadata(PREFIX + key) for key in DIM_KEYS}
    _check_dims(dims, source, config)
    template = SoftTokenLibrary(*(dims[k] for k in DIM_KEYS))
    tensors = {}
    for name, t in template.state_dict().items():
        values = metadata(PREFIX + name)
        if not isinstance(values, list) or len(values) != t.numel():
            raise MetaSoftFileError(f"{source}: '{PREFIX + name}' must hold {t.numel()} numbers")
        try:
            tensors[name] = torch.tensor(values, dtype=torch.float32).view(t.shape)
        except (TypeError, ValueError):
            raise MetaSoftFileError(f"{source}: '{PREFIX + name}' must hold numbers") from None
    return _build(dims, tensors, source, config), json_object(metadata(PREFIX + "info"), "metasoft.info", source)


# -- which soft tokens a model runs with -------------------------------------------------------------------
def packaged_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "metasoft"


def find_trained_library(gguf_file: Any, config: ModelConfig) -> tuple[SoftTokenLibrary, dict[str, Any], str] | None:
    """Meta-Soft's trained soft tokens for a GGUF model: baked into it, else packaged for exactly this
    model file (matched by sha256), else None. Returns (library, info, a line saying which)."""
    baked = read_gguf_library(gguf_file.metadata, gguf_file.keys(), gguf_file.path.name, config)
    if baked is not None:
        return (*baked, f"Meta-Soft: trained soft tokens baked into {gguf_file.path.name} "
                        f"({baked[1].get('steps', '?')} steps)")
    candidates = sorted(packaged_dir().glob("*.safetensors"))
    if candidates:
        from ..persistence import file_sha256

        sha = file_sha256(gguf_file.path)
        for path in candidates:
            library, info = load_library(path, config)
            if info.get("model_sha256") == sha:
                return library, info, f"Meta-Soft: trained soft tokens packaged for this model ({path.name})"
    return None
