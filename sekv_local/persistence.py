"""Saved document memories: safetensors + a JSON header, checksummed, written atomically.

A memory is only valid for the model file, cache method and settings that built it; the header
records them and loading refuses anything else with a clear message.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import SekvError

FORMAT_VERSION = 3  # 2: "bounds" router rows per layer; 3: router rank gate, per-layer projections
HEADER_KEY = "sekv_local"
MAX_HEADER_BYTES = 16 * 1024 * 1024


class MemoryFileError(SekvError):
    """A saved memory that cannot be used (corrupt, truncated, tampered, or for something else)."""


@lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, cached per (path, size, mtime) so a model is hashed once per process."""
    st = os.stat(path)
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def memory_checksum(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> str:
    """Covers the tensors and every header field (a header edit is tampering too)."""
    fields = {k: v for k, v in header.items() if k != "checksum"}
    return hashlib.sha256((tensors_checksum(tensors) + json.dumps(fields, sort_keys=True)).encode()).hexdigest()


def save_memory(path: str | Path, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    """Write atomically (see `atomic_write`): a kill at any point leaves the old file or the new one."""
    from safetensors.torch import save_file

    plain = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    full_header = {**header, "format_version": FORMAT_VERSION}
    full_header["checksum"] = memory_checksum(plain, full_header)
    with atomic_write(path) as tmp:
        save_file(plain, str(tmp), metadata={HEADER_KEY: json.dumps(full_header)})


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the same folder to write; on success fsync it, rename it over `path`
    and fsync the folder. On failure (or a kill) `path` keeps its old content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale_temporaries(path: Path) -> None:
    """Temporary files of earlier saves whose writer died (killed mid-save) are garbage: remove them."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            pid = int(tmp.name[len(path.name) + 2: -len(".tmp")])
            os.kill(pid, 0)  # raises if no such process
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            continue  # not ours, or a live writer of another user: leave it


def read_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a saved memory (cheap: tensors are not read)."""
    path = Path(path)
    if not path.is_file():
        raise MemoryFileError(f"saved memory not found: {path}")
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if size <= 0 or size > MAX_HEADER_BYTES or size + 8 > path.stat().st_size:
                raise MemoryFileError(f"{path} is not a sekv-local memory file (bad safetensors header)")
            outer = json.loads(fh.read(size))
        meta = outer.get("__metadata__") if isinstance(outer, dict) else None
        header = json.loads(meta[HEADER_KEY]) if isinstance(meta, dict) else None
        if not isinstance(header, dict):
            raise MemoryFileError(f"{path} is not a sekv-local memory file (no sekv-local header)")
    except MemoryFileError:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, OSError) as exc:
        raise MemoryFileError(f"{path} is not a sekv-local memory file ({exc.__class__.__name__})") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise MemoryFileError(f"{path} has memory format {header.get('format_version')}; this sekv-local reads "
                              f"format {FORMAT_VERSION}")
    return header


def load_memory(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and header, after verifying the checksum."""
    from safetensors.torch import load_file

    header = read_header(path)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on truncated/corrupt data
        raise MemoryFileError(f"{path} is truncated or corrupt: {exc}") from None
    if memory_checksum(tensors, header) != header.get("checksum"):
        raise MemoryFileError(f"{path} failed its checksum: the file was modified or damaged")
    return tensors, header
