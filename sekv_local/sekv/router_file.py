"""Trained router parameters as a file: safetensors on their own, `sekv.*` metadata inside a GGUF.

One in-memory form, :class:`RouterParams`, and three ways to move it: a router file
(`save_router` / `load_router`, safetensors + JSON metadata), `sekv.*` GGUF metadata entries
(`gguf_entries` to write, `read_gguf_router` to read) and a live :class:`Router` (`params_of` /
`build_router`).

In a GGUF the parameters are metadata arrays (`sekv.blk.N.q_proj`, flattened f32 in row-major
order, shape given by the `sekv.*` dims), not tensors: stock llama.cpp refuses a file with tensors
that its architecture does not create ("done_getting_tensors: wrong number of tensors"), and a
baked GGUF must stay loadable by every llama.cpp.

Everything read from a file is untrusted: dims are bounded, array lengths checked against them,
values must be finite, JSON must be objects; any defect raises :class:`RouterFileError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import SekvError
from ..models.config import ModelConfig
from .config import FILE_CHOICES, SekvConfig
from .router import PARAMETER_SHAPES, Router

FORMAT_VERSION = 1
PREFIX = "sekv."
DIM_KEYS = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "routing_dim")
_MAX_DIM = 65536
_MAX_JSON = 1 << 20


class RouterFileError(SekvError):
    """A router file or a GGUF's `sekv.*` data is unusable (corrupt, another version, other dims)."""


@dataclass
class RouterParams:
    """dims: the model dims and d' the parameters were trained for; hparams: SekvConfig fields used in
    training; info: provenance (model, seed, steps, losses); tensors: PARAMETER_SHAPES names -> [L, ...]."""

    dims: dict[str, int]
    tensors: dict[str, torch.Tensor]
    hparams: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def shape(self, name: str, per_layer: bool = False) -> tuple[int, ...]:
        letters = {"L": self.dims["n_layers"], "H": self.dims["n_heads"], "KV": self.dims["n_kv_heads"],
                   "D": self.dims["head_dim"], "d'": self.dims["routing_dim"]}
        full = tuple(letters[x] for x in PARAMETER_SHAPES[name])
        return full[1:] if per_layer else full

    def check_model(self, config: ModelConfig, source: str) -> None:
        """Refuse parameters trained for other dims than this model's."""
        have = {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
                "head_dim": config.head_dim}
        wrong = [f"{k} {self.dims[k]} (model: {v})" for k, v in have.items() if self.dims[k] != v]
        if wrong:
            raise RouterFileError(f"{source}: the SeKV router was trained for another model: {', '.join(wrong)}")


def _check_dims(dims: dict[str, Any], source: str) -> dict[str, int]:
    out = {}
    for key in DIM_KEYS:
        value = dims.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_DIM:
            raise RouterFileError(f"{source}: router dim '{key}' must be an integer in [1, {_MAX_DIM}], got {value!r}")
        out[key] = value
    if out["n_heads"] % out["n_kv_heads"]:
        raise RouterFileError(f"{source}: n_heads {out['n_heads']} is not a multiple of n_kv_heads {out['n_kv_heads']}")
    if out["routing_dim"] > out["head_dim"]:
        raise RouterFileError(f"{source}: routing_dim {out['routing_dim']} exceeds head_dim {out['head_dim']}")
    return out


def json_object(text: Any, what: str, source: str) -> dict[str, Any]:
    if not isinstance(text, str) or len(text) > _MAX_JSON:
        raise RouterFileError(f"{source}: {what} must be a JSON string under {_MAX_JSON} bytes")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RouterFileError(f"{source}: {what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RouterFileError(f"{source}: {what} must be a JSON object")
    return value


def _check_tensors(params: RouterParams, source: str) -> None:
    for name in PARAMETER_SHAPES:
        t = params.tensors.get(name)
        if t is None:
            raise RouterFileError(f"{source}: router parameter '{name}' is missing")
        if tuple(t.shape) != params.shape(name):
            raise RouterFileError(f"{source}: router parameter '{name}' has shape {tuple(t.shape)}, "
                                  f"expected {params.shape(name)}")
        if not torch.isfinite(t).all():
            raise RouterFileError(f"{source}: router parameter '{name}' holds non-finite values")


def _check_version(version: Any, source: str) -> None:
    if version != FORMAT_VERSION:
        raise RouterFileError(f"{source}: SeKV router format version {version!r} is not supported "
                              f"(this sekv-local reads version {FORMAT_VERSION})")


# -- live router ---------------------------------------------------------------------------------------
def params_of(router: Router, config: ModelConfig, hparams: dict[str, Any] | None = None,
              info: dict[str, Any] | None = None) -> RouterParams:
    dims = {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "routing_dim": router.routing_dim}
    tensors = {name: getattr(router, name).detach().float().cpu().clone() for name in PARAMETER_SHAPES}
    return RouterParams(dims, tensors, dict(hparams or {}), dict(info or {}))


def build_router(params: RouterParams, config: ModelConfig, source: str = "router") -> Router:
    """A trained Router for `config` from `params` (dims checked first)."""
    params.check_model(config, source)
    router = Router(config, SekvConfig(routing_dim=params.dims["routing_dim"]))
    for option, (key, choices) in FILE_CHOICES.items():
        value = params.info.get(key, choices[0])
        if value not in choices:
            raise RouterFileError(f"{source}: {key} must be one of {choices}, got {value!r}")
        router.auto_choices[option] = value
    with torch.no_grad():
        for name in PARAMETER_SHAPES:
            getattr(router, name).copy_(params.tensors[name])
    router.trained = True
    router.requires_grad_(False)
    return router


# -- router file (safetensors) -------------------------------------------------------------------------
def save_router(path: str | Path, params: RouterParams) -> Path:
    """Write the router file atomically."""
    from safetensors.torch import save_file

    from ..persistence import atomic_write

    _check_tensors(params, str(path))
    metadata = {"sekv.format_version": str(FORMAT_VERSION), "sekv.dims": json.dumps(params.dims),
                "sekv.hparams": json.dumps(params.hparams), "sekv.info": json.dumps(params.info)}
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in params.tensors.items()}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def load_router(path: str | Path) -> RouterParams:
    from safetensors import SafetensorError, safe_open

    source = str(path)
    if not Path(path).is_file():
        raise RouterFileError(f"router file not found: {path}")
    try:
        with safe_open(source, framework="pt") as fh:
            meta = fh.metadata() or {}
            names = set(fh.keys())
            unknown = names - set(PARAMETER_SHAPES)
            if unknown:
                raise RouterFileError(f"{source}: unknown router parameters {sorted(unknown)}")
            tensors = {name: fh.get_tensor(name).float() for name in names}
    except (SafetensorError, OSError, ValueError) as exc:
        raise RouterFileError(f"{source} is not a readable router file ({exc})") from None
    _check_version(int(meta["sekv.format_version"]) if str(meta.get("sekv.format_version", "")).isdigit() else
                   meta.get("sekv.format_version"), source)
    params = RouterParams(_check_dims(json_object(meta.get("sekv.dims"), "sekv.dims", source), source), tensors,
                          json_object(meta.get("sekv.hparams", "{}"), "sekv.hparams", source),
                          json_object(meta.get("sekv.info", "{}"), "sekv.info", source))
    _check_tensors(params, source)
    return params


def set_file_choices(path: str | Path, changes: dict[str, str]) -> dict[str, str]:
    """Set what SeKV's "auto" options run with the router file at `path` (info keys of FILE_CHOICES, e.g.
    {"zoom_pool": "free"}), rewriting it only when something changes; the parameters are copied untouched.
    Returns every choice the file now settles (a key it does not name: its default)."""
    choices = {key: allowed for key, allowed in FILE_CHOICES.values()}
    for key, value in changes.items():
        if key not in choices or value not in choices[key]:
            raise RouterFileError(f"{path}: {key}={value!r} is not a router file choice "
                                  f"({', '.join(f'{k}: {v}' for k, v in choices.items())})")
    params = load_router(path)
    if any(params.info.get(key) != value for key, value in changes.items()):
        params.info.update(changes)
        save_router(path, params)
    return {key: params.info.get(key, allowed[0]) for key, allowed in choices.items()}


# -- GGUF metadata ---------------------------------------------------------------------------------------
def gguf_entries(params: RouterParams) -> list[tuple[str, Any, str]]:
    """(key, value, kind) to write into a GGUF; kind is "u32", "str" or "f32[]" (flattened, row-major)."""
    entries: list[tuple[str, Any, str]] = [(PREFIX + "format_version", FORMAT_VERSION, "u32")]
    entries += [(PREFIX + key, params.dims[key], "u32") for key in DIM_KEYS]
    entries += [(PREFIX + "hparams", json.dumps(params.hparams), "str"),
                (PREFIX + "info", json.dumps(params.info), "str")]
    for layer in range(params.dims["n_layers"]):
        for name in PARAMETER_SHAPES:
            values = params.tensors[name][layer].reshape(-1).float().tolist()
            entries.append((f"{PREFIX}blk.{layer}.{name}", values, "f32[]"))
    return entries


def read_gguf_router(metadata: Callable[[str], Any], keys: list[str], source: str) -> RouterParams | None:
    """The router in a GGUF's `sekv.*` metadata, or None when it has none. `metadata(key)` returns a
    key's value (None when absent), `keys` all keys."""
    if not any(k.startswith(PREFIX) for k in keys):
        return None
    _check_version(metadata(PREFIX + "format_version"), source)
    dims = _check_dims({k: metadata(PREFIX + k) for k in DIM_KEYS}, source)
    params = RouterParams(dims, {}, json_object(metadata(PREFIX + "hparams"), "sekv.hparams", source),
                          json_object(metadata(PREFIX + "info"), "sekv.info", source))
    for name in PARAMETER_SHAPES:
        per_layer = params.shape(name, per_layer=True)
        count = math.prod(per_layer)
        rows = []
        for layer in range(dims["n_layers"]):
            key = f"{PREFIX}blk.{layer}.{name}"
            values = metadata(key)
            if not isinstance(values, list) or len(values) != count:
                got = f"{len(values)} values" if isinstance(values, list) else repr(type(values).__name__)
                raise RouterFileError(f"{source}: '{key}' must hold {count} numbers, got {got}")
            try:
                rows.append(torch.tensor(values, dtype=torch.float32).view(per_layer))
            except (TypeError, ValueError):
                raise RouterFileError(f"{source}: '{key}' must hold numbers") from None
        params.tensors[name] = torch.stack(rows)
    _check_tensors(params, source)
    return params


# -- which router a model runs with ------------------------------------------------------------------------
def packaged_routers_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "routers"


def find_trained_router(gguf_file: Any) -> tuple[RouterParams | None, str]:
    """The router SeKV uses with a GGUF model: the one baked into it, else a packaged one trained for
    exactly this model file (matched by sha256), else none. Returns (params, a line saying which)."""
    params = gguf_file.router_params()
    if params is not None:
        return params, f"SeKV router: trained, baked into {gguf_file.path.name}"
    candidates = sorted(packaged_routers_dir().glob("*.safetensors"))
    if candidates:
        from ..persistence import file_sha256

        sha = file_sha256(gguf_file.path)
        for path in candidates:
            packaged = load_router(path)
            if packaged.info.get("model_sha256") == sha:
                return packaged, f"SeKV router: trained, packaged for this model ({path.name})"
    return None, (f"SeKV router: {gguf_file.path.name} carries no trained router (sekv.*); "
                  "running the untrained defaults")
