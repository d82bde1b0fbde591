"""The storage types a cache method may keep its rows in: the `dtype` option every method takes."""

from __future__ import annotations

import torch

from .errors import SekvError

#: option value -> torch storage type
CACHE_DTYPES: dict[str, torch.dtype] = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def check_cache_dtype(method: str, value: object) -> None:
    """Refuse a `dtype` option that names no storage type, in the words every method uses."""
    if value not in CACHE_DTYPES:
        raise SekvError(f"{method}: dtype must be one of {', '.join(CACHE_DTYPES)}, got {value!r}")
