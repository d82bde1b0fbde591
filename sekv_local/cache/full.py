"""`full`: the plain KV cache (every token, every layer, f16 by default) — the baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .attention import CausalBias, gqa_attention
from .base import CachePolicy, register_policy

_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(frozen=True)
class FullConfig:
    """dtype: storage type of cached K/V ("f16" matches the full-KV baseline of DESIGN §4).
    grow_tokens: capacity is allocated in steps of this many tokens (the slack is counted as used).
    max_tokens: most tokens accepted; 0 = the model's trained context. Larger values run positions the
    model never saw (the reference for "beyond the trained context" measurements)."""

    dtype: str = "f16"
    grow_tokens: int = 256
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise SekvError(f"full: dtype must be one of {sorted(_DTYPES)}, got '{self.dtype}'")
        if self.grow_tokens < 1:
            raise SekvError("full: grow_tokens must be >= 1")
        if self.max_tokens < 0:
            raise SekvError("full: max_tokens must be >= 0 (0 = the model's trained context)")


class GrowingKV:
    """Post-RoPE keys and values of one layer in a buffer grown in fixed steps.

    k, v: [n_kv_heads, capacity, head_dim]; the first `length` positions are valid.
    """

    def __init__(self, n_kv: int, head_dim: int, dtype: torch.dtype, step: int, device: torch.device) -> None:
        self.k = torch.empty(n_kv, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(n_kv, 0, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.step = step

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        need = self.length + n
        if need > self.k.shape[1]:
            capacity = -(-need // self.step) * self.step
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.k[:, self.length: need] = k
        self.v[:, self.length: need] = v
        self.length = need

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]


class FullCache(CachePolicy):
    name = "full"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        if budget not in (None, 1, 1.0):
            raise SekvError("full: keeps every token; it takes no --budget (use a compressing method)")
        self.cfg = FullConfig(**options)
        self._causal = CausalBias(self.device)
        self.layers = [GrowingKV(config.n_kv_heads, config.head_dim, _DTYPES[self.cfg.dtype], self.cfg.grow_tokens,
                                 self.device) for _ in range(config.n_layers)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = self.layers[layer]
        store.append(self.rope.apply(k, self._positions, self._cos_sin), v)
        q_rot = self.rope.apply(q, self._positions, self._cos_sin)
        keys, values = store.keys(), store.values()
        return gqa_attention(q_rot, keys, values, bias=self._causal(q.shape[1], keys.shape[1]))

    def max_tokens(self) -> int | None:
        return self.cfg.max_tokens or self.config.context_length

    def mark(self) -> tuple[int, int]:
        return (self.n_tokens, self.layers[0].length)

    def rollback(self, mark: tuple[int, int]) -> None:
        self.n_tokens = mark[0]
        for store in self.layers:
            store.truncate(mark[1])

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {}
        for i, store in enumerate(self.layers):
            tensors[f"L{i}.k"], tensors[f"L{i}.v"] = store.keys(), store.values()
        return tensors, {"n_tokens": self.n_tokens, "length": self.layers[0].length}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        length = int(meta["length"])
        c = self.config
        for i, store in enumerate(self.layers):
            k, v = tensors[f"L{i}.k"], tensors[f"L{i}.v"]
            if k.shape != (c.n_kv_heads, length, c.head_dim) or v.shape != k.shape:
                raise ValueError(f"layer {i}: K/V of shape {tuple(k.shape)} do not fit the model")
            store.truncate(0)
            store.append(k, v)
        self.n_tokens = int(meta["n_tokens"])

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        store = self.layers[layer]
        return [store.k, store.v]


@register_policy("full")
def _make(**kwargs: Any) -> FullCache:
    return FullCache(**kwargs)
