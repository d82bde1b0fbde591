"""`h2o` (Heavy-Hitter Oracle): keep the keys that received the most attention, plus a recent window.

Every kept key carries its accumulated attention: the attention probability it has received from
every query since it entered the cache, summed over the query heads of its KV group. Each KV head
keeps its own tokens (its heavy hitters differ). The cache holds at most `capacity` tokens per
layer and KV head, in tensors of that size allocated once from the budget: `recent_fraction` of them
is a window of the newest tokens, the rest are the heavy hitters.

Chunked prefill and decode work the same way: before a chunk of T tokens is written, the T
lowest-score tokens outside the part of the recent window that survives the chunk are evicted (their
scores go with them), so the device tier never exceeds the budget; then the chunk's queries attend to
the kept tokens plus the chunk, and every kept key adds the attention it received. The scores come
from the same exact attention that produces the output, computed in blocks of queries
(`scoring.attention_scores`), so no [T, T] matrix of a long context ever exists. This is the
streaming form of H2O (the paper scores a whole prompt at once, which needs its full KV on the
device). Positions: every token keeps its original position (as `streaming` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .base import CachePolicy, register_policy
from .budget import budget_tokens, resolve_budget_bytes
from .scoring import PROTECTED_RANK, ScoredKV, attention_scores, drop_lowest

_MIN_TOKENS = 8


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class H2OConfig:
    """recent_fraction: share of the per-layer token budget kept as the recent window (0.5 in the
    paper: half heavy hitters, half recent); chunk_fraction: share of the budget one prefill chunk may
    take; dtype: storage type of the kept K/V."""

    recent_fraction: float = 0.5
    chunk_fraction: float = 0.25
    dtype: str = "f16"

    def __post_init__(self) -> None:
        if not _is_number(self.recent_fraction) or not 0 <= self.recent_fraction < 1:
            raise SekvError(f"h2o: recent_fraction must be in [0, 1), got {self.recent_fraction!r}")
        if not _is_number(self.chunk_fraction) or not 0 < self.chunk_fraction < 1:
            raise SekvError(f"h2o: chunk_fraction must be in (0, 1), got {self.chunk_fraction!r}")
        check_cache_dtype("h2o", self.dtype)


class H2OCache(CachePolicy):
    name = "h2o"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        try:
            self.cfg = H2OConfig(**options)
        except TypeError as exc:
            raise SekvError(f"h2o: {exc}") from None
        self.budget_spec = budget
        self.reserve(config.context_length)

    @property
    def token_bytes(self) -> int:
        """Device bytes per kept token over all layers: K, V, and per KV head a position and a score."""
        c = self.config
        return c.n_layers * ScoredKV.bytes_per_token(c.n_kv_heads, c.head_dim, c.n_kv_heads, CACHE_DTYPES[self.cfg.dtype])

    def reserve(self, n_tokens: int) -> None:
        if self.n_tokens:
            raise SekvError("h2o: reserve() must come before the first token")
        budget_bytes = resolve_budget_bytes(self.budget_spec, self.config, n_tokens, self.name)
        self.layers: list[ScoredKV] = []  # free the previous allocation first
        self.capacity = budget_tokens(budget_bytes, self.token_bytes, _MIN_TOKENS, self.name)
        self.recent = int(round(self.capacity * self.cfg.recent_fraction))
        self.chunk_tokens = max(1, int(self.capacity * self.cfg.chunk_fraction))
        c = self.config
        self.layers = [ScoredKV(c.n_kv_heads, c.head_dim, self.capacity, c.n_kv_heads, CACHE_DTYPES[self.cfg.dtype],
                                self.device) for _ in range(c.n_layers)]

    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        positions = self._positions
        q_rot = self.rope.apply(q, positions, self._cos_sin)
        k_rot = self.rope.apply(k, positions, self._cos_sin)
        step = self.chunk_tokens  # a longer chunk (e.g. the engine's scoring path) is taken in parts
        outs = [self._attend_part(self.layers[layer], q_rot[:, a: a + step], k_rot[:, a: a + step],
                                  v[:, a: a + step], positions[a: a + step])
                for a in range(0, positions.shape[0], step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend_part(self, store: ScoredKV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        n_new = positions.shape[0]
        n_drop = store.length + n_new - store.capacity
        if n_drop > 0:
            self._evict(store, n_drop, int(positions[0]), n_new)
        store.append(k, v, positions, 0.0)
        out, received = attention_scores(q, store.keys(), positions, store.positions(), store.values())
        store.score[:, : store.length] += received
        return out

    def _evict(self, store: ScoredKV, n_drop: int, next_pos: int, n_new: int) -> None:
        """Drop the n_drop lowest-score tokens per KV head, sparing those that stay in the recent
        window once the n_new incoming tokens are added."""
        pos = store.positions()
        protected = pos >= next_pos - max(self.recent - n_new, 0)
        rank = torch.where(protected, PROTECTED_RANK + pos.double(), store.scores().double())
        store.keep(~drop_lowest(rank, n_drop))

    def _checkpoint(self) -> Any:
        """A snapshot in host memory (eviction compacts the tensors in place)."""
        return (self.n_tokens, [store.snapshot() for store in self.layers])

    def _restore(self, mark: Any) -> None:
        self.n_tokens, snaps = mark
        for store, snap in zip(self.layers, snaps):
            store.restore(snap)

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        return self.layers[layer].tensors()


@register_policy("h2o")
def _make(**kwargs: Any) -> H2OCache:
    return H2OCache(**kwargs)
