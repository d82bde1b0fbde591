"""`full`: the plain KV cache (every token, every layer, f16 by default) — the baseline.

On models with sliding-window layers (Gemma 3) those layers keep only what their queries can still
see: the last `sliding_window - 1` tokens (plus at most `grow_tokens` not yet dropped, and the chunk
being read), as llama.cpp's SWA cache does; keys further back are masked out of the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .attention import CausalBias, gqa_attention
from .base import CachePolicy, register_policy


@dataclass(frozen=True)
class FullConfig:
    """dtype: storage type of cached K/V ("f16" matches the full-KV baseline of docs/DESIGN.md §4).
    grow_tokens: capacity is allocated in steps of this many tokens (the slack is counted as used).
    max_tokens: most tokens accepted; 0 = the model's trained context. Larger values run positions the
    model never saw (the reference for "beyond the trained context" measurements)."""

    dtype: str = "f16"
    grow_tokens: int = 256
    max_tokens: int = 0

    def __post_init__(self) -> None:
        check_cache_dtype("full", self.dtype)
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
        self.reserve(need)
        self.k[:, self.length: need] = k
        self.v[:, self.length: need] = v
        self.length = need

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows (rounded up to the step). Reading a document into a buffer sized for it once
        allocates it once: growing chunk by chunk copies every row at each step and leaves the old buffers
        as holes in the heap."""
        if rows <= self.k.shape[1]:
            return
        capacity = -(-rows // self.step) * self.step
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]


class WindowKV(GrowingKV):
    """Post-RoPE K/V of a sliding-window layer: rows of the last `keep` positions (and some slack).

    Rows are consecutive positions; `start` is the absolute position of row 0. `evict` drops rows no
    future query can see, but only once at least `step` of them piled up (one copy per `step`
    decode tokens), moving the survivors into a right-sized buffer so memory stays bounded.
    """

    def __init__(self, n_kv: int, head_dim: int, dtype: torch.dtype, step: int, device: torch.device,
                 keep: int) -> None:
        super().__init__(n_kv, head_dim, dtype, step, device)
        self.keep = keep
        self.start = 0

    def evict(self) -> None:
        drop = self.length - self.keep
        if drop < self.step:
            return
        capacity = -(-(self.keep + self.step) // self.step) * self.step
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
            new[:, : self.keep] = old[:, drop: self.length]
            setattr(self, name, new)
        self.length = self.keep
        self.start += drop

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(start, K rows, V rows) copied, to restore with `restore` after later evictions."""
        return self.start, self.keys().clone(), self.values().clone()

    def restore(self, snapshot: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        start, k, v = snapshot
        self.length = 0
        self.start = start
        self.append(k, v)


class FullCache(CachePolicy):
    name = "full"
    supports_sliding_window = True

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        if budget not in (None, 1, 1.0):
            raise SekvError("full: keeps every token; it takes no --budget (use a compressing method)")
        self.cfg = FullConfig(**options)
        self._causal = CausalBias(self.device)
        self._causal_local = CausalBias(self.device, window=config.sliding_window)
        dtype, step = CACHE_DTYPES[self.cfg.dtype], self.cfg.grow_tokens
        self.layers: list[GrowingKV] = [
            WindowKV(config.n_kv_heads, config.head_dim, dtype, step, self.device, keep=config.sliding_window - 1)
            if config.is_local(i) else GrowingKV(config.n_kv_heads, config.head_dim, dtype, step, self.device)
            for i in range(config.n_layers)]
        self._global = [i for i in range(config.n_layers) if not config.is_local(i)]
        self._windows = {i: store for i, store in enumerate(self.layers) if isinstance(store, WindowKV)}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = self.layers[layer]
        rope, cos_sin = self.layer_rope(layer)
        store.append(rope.apply(k, self._positions, cos_sin), v)
        q_rot = rope.apply(q, self._positions, cos_sin)
        keys, values = store.keys(), store.values()
        causal = self._causal_local if isinstance(store, WindowKV) else self._causal
        out = gqa_attention(q_rot, keys, values, bias=causal(q.shape[1], keys.shape[1]))
        if isinstance(store, WindowKV):
            store.evict()
        return out

    def reserve(self, n_tokens: int) -> None:
        """Room for the document in every global layer, allocated now (the conversation grows it by steps)."""
        for i in self._global:
            self.layers[i].reserve(n_tokens)

    def max_tokens(self) -> int | None:
        return self.cfg.max_tokens or self.config.context_length

    def _checkpoint(self) -> tuple[int, int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]]:
        """(tokens, rows of the global layers, copies of the sliding-window layers' rows: they may be
        evicted after the mark, so truncating cannot bring them back)."""
        snapshots = {i: store.snapshot() for i, store in self._windows.items()}
        length = self.layers[self._global[0]].length if self._global else self.n_tokens
        return (self.n_tokens, length, snapshots)

    def _restore(self, mark: tuple[int, int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]]) -> None:
        self.n_tokens = mark[0]
        for i in self._global:
            self.layers[i].truncate(mark[1])
        for i, snapshot in mark[2].items():
            self._windows[i].restore(snapshot)

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {}
        for i, store in enumerate(self.layers):
            tensors[f"L{i}.k"], tensors[f"L{i}.v"] = store.keys(), store.values()
        meta: dict[str, Any] = {"n_tokens": self.n_tokens,
                                "length": self.layers[self._global[0]].length if self._global else 0}
        if self._windows:
            local = next(iter(self._windows.values()))  # every local layer holds the same positions
            meta["local_start"], meta["local_length"] = local.start, local.length
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        c = self.config
        for i, store in enumerate(self.layers):
            length = int(meta["local_length"] if c.is_local(i) else meta["length"])
            k, v = tensors[f"L{i}.k"], tensors[f"L{i}.v"]
            if k.shape != (c.n_kv_heads, length, c.head_dim) or v.shape != k.shape:
                raise ValueError(f"layer {i}: K/V of shape {tuple(k.shape)} do not fit the model")
            store.truncate(0)
            store.append(k, v)
            if isinstance(store, WindowKV):
                store.start = int(meta["local_start"])
        self.n_tokens = int(meta["n_tokens"])

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        store = self.layers[layer]
        return [store.k, store.v]


@register_policy("full")
def _make(**kwargs: Any) -> FullCache:
    return FullCache(**kwargs)
