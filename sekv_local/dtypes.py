"""The storage types a cache method may keep its rows in: the `dtype` option every method takes."""

from __future__ import annotations

import torch

#: option value -> torch storage type
CACHE_DTYPES: dict[str, torch.dtype] = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
CACHE_DTYPE_NAMES: tuple[str, ...] = tuple(CACHE_DTYPES)


def dtype_error(value: object) -> str:
    """The message for a `dtype` option that names no storage type."""
    return f"dtype must be one of {', '.join(CACHE_DTYPE_NAMES)}, got {value!r}"
