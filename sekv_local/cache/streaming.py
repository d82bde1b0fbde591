"""`streaming` (StreamingLLM): attention-sink tokens + the most recent tokens; the rest is evicted.

Positions: every token keeps its original position (as most harnesses do), so the method is limited
to the model's trained context like full KV. Storage is a ring buffer whose size is fixed by the
budget; a prefill chunk is written after making room for it, so the device tier never exceeds the
budget, prefill included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .attention import gqa_attention
from .base import CachePolicy, register_policy
from .budget import budget_tokens, resolve_budget_bytes


@dataclass(frozen=True)
class StreamingConfig:
    """n_sink: sink tokens kept forever (4 in the paper); chunk_fraction: share of the budget a prefill
    chunk may take (the rest holds the window while the chunk is processed)."""

    n_sink: int = 4
    chunk_fraction: float = 0.25
    dtype: str = "f16"

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise SekvError("streaming: n_sink must be >= 0")
        if not 0 < self.chunk_fraction < 1:
            raise SekvError("streaming: chunk_fraction must be in (0, 1)")
        check_cache_dtype("streaming", self.dtype)


class StreamingCache(CachePolicy):
    name = "streaming"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        self.cfg = StreamingConfig(**options)
        self.budget_spec = budget
        self.reserve(config.context_length)

    @property
    def token_bytes(self) -> int:
        c = self.config
        return c.n_layers * 2 * c.n_kv_heads * c.head_dim * CACHE_DTYPES[self.cfg.dtype].itemsize + 8

    def reserve(self, n_tokens: int) -> None:
        if self.n_tokens:
            raise SekvError("streaming: reserve() must come before the first token")
        budget_bytes = resolve_budget_bytes(self.budget_spec, self.config, n_tokens, self.name)
        self.capacity = budget_tokens(budget_bytes, self.token_bytes, self.cfg.n_sink + 8, self.name)
        self.chunk_tokens = max(1, int(self.capacity * self.cfg.chunk_fraction))
        c, dt = self.config, CACHE_DTYPES[self.cfg.dtype]
        # per layer: keys and values [KV, capacity, D], allocated once for the whole budget
        self.k = [torch.zeros(c.n_kv_heads, self.capacity, c.head_dim, dtype=dt, device=self.device)
                  for _ in range(c.n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.pos = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)  # -1 = empty slot
        self.count = 0  # tokens ever written (slot order: sinks first, then a ring)
        self._slots: torch.Tensor | None = None

    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens

    def _slots_for(self, n: int) -> torch.Tensor:
        """Slots for the next n tokens: sinks fill first, then the ring overwrites the oldest tokens."""
        idx = torch.arange(self.count, self.count + n, device=self.device)
        sink, ring = self.cfg.n_sink, self.capacity - self.cfg.n_sink
        if n > ring:
            raise SekvError(f"streaming: a chunk of {n} tokens does not fit a window of {ring}")
        return torch.where(idx < sink, idx, sink + (idx - sink) % ring)

    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        super().begin_chunk(positions, is_prefill)
        self._slots = self._slots_for(positions.shape[0])
        # attention sees the cache *before* this chunk overwrites anything, plus the chunk itself
        self._old_pos = self.pos.clone()
        self.pos[self._slots] = positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rot = self.rope.apply(k, self._positions, self._cos_sin)
        q_rot = self.rope.apply(q, self._positions, self._cos_sin)
        old_k, old_v = self.k[layer].float(), self.v[layer].float()
        keys = torch.cat([old_k, k_rot], dim=1)
        values = torch.cat([old_v, v], dim=1)
        # old slots that this chunk overwrites are still visible to it (the chunk evicts them after)
        key_pos = torch.cat([self._old_pos, self._positions])
        visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= self._positions[:, None])
        bias = torch.where(visible, 0.0, float("-inf"))[None]
        out = gqa_attention(q_rot, keys, values, bias=bias)
        self.k[layer][:, self._slots] = k_rot.to(self.k[layer].dtype)
        self.v[layer][:, self._slots] = v.to(self.v[layer].dtype)
        return out

    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        self.count += int(token_ids.shape[0])
        super().end_chunk(logits, token_ids)

    def _checkpoint(self) -> Any:
        """A snapshot in host memory (the ring overwrites in place, so a rollback needs the old rows)."""
        return (self.n_tokens, self.count, [t.cpu().clone() for t in self.k], [t.cpu().clone() for t in self.v],
                self.pos.clone())

    def _restore(self, mark: Any) -> None:
        self.n_tokens, self.count, ks, vs, pos = mark
        for dst, src in zip(self.k + self.v, ks + vs):
            dst.copy_(src)
        self.pos.copy_(pos)

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        return [self.k[layer], self.v[layer]] + ([self.pos] if layer == 0 else [])


@register_policy("streaming")
def _make(**kwargs: Any) -> StreamingCache:
    return StreamingCache(**kwargs)
