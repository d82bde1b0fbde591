"""`chunkkv`: SnapKV's scores, but tokens are kept and evicted in fixed chunks of consecutive positions.

A token's score is SnapKV's (observation-window attention, averaged over each GQA group, pooled)
summed over the layer's KV heads; a chunk's score is the mean over its kept tokens; eviction drops
the lowest-scoring whole chunks, so all KV heads of a layer keep the same tokens (one row of
positions and scores per layer: keys/values [KV, C, D], positions [1, C]). Chunks are fixed by
position (tokens [10k, 10k + 10), 10 in the paper, 20 in kvpress). The protected window is widened
to whole chunks (every chunk holding one of the last `window` positions), so a chunk is complete when
it first becomes evictable and leaves whole. Eviction frees at least the room a chunk needs (a whole
chunk at a time, so up to chunk_size - 1 slots more). Chunked prefill, the final selection and the
question-agnostic/aware modes are SnapKV's (see `snapkv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import SekvError
from .base import register_policy
from .scoring import PROTECTED_RANK, UNSCORED_RANK, ScoredKV
from .snapkv import SnapKVCache, SnapKVConfig, is_int


@dataclass(frozen=True)
class ChunkKVConfig(SnapKVConfig):
    """chunk_size: tokens per chunk (10 in the paper)."""

    method: ClassVar[str] = "chunkkv"

    chunk_size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int(self.chunk_size) or self.chunk_size < 1:
            raise SekvError(f"chunkkv: chunk_size must be an integer >= 1, got {self.chunk_size!r}")


class ChunkKVCache(SnapKVCache):
    name = "chunkkv"
    config_class = ChunkKVConfig
    shared_rows = True

    def min_tokens(self) -> int:
        return self.cfg.window + 2 * self.cfg.chunk_size + 16

    def part_tokens(self, layer: int) -> int:
        cap = self.layers[layer].capacity
        return max(1, min(self.chunk_tokens, (cap - self.cfg.window - self.cfg.chunk_size) // 2))

    def drop_mask(self, store: ScoredKV, n_drop: int, next_pos: int) -> torch.Tensor:
        """Drop the lowest-ranked whole chunks until at least n_drop slots are free."""
        size = self.cfg.chunk_size
        pos = store.positions()[0].long()
        score = store.scores()[0].double()
        chunk_ids, inverse, counts = torch.unique_consecutive(pos // size, return_inverse=True, return_counts=True)
        n_chunks = chunk_ids.shape[0]
        mean = torch.zeros(n_chunks, dtype=torch.float64, device=pos.device).index_add_(0, inverse, score) / counts
        unscored = torch.zeros(n_chunks, dtype=torch.long, device=pos.device).index_add_(
            0, inverse, (score < 0).long()) > 0
        first = (chunk_ids * size).double()
        rank = torch.where(unscored, UNSCORED_RANK + first, mean)
        protected = (chunk_ids + 1) * size - 1 >= next_pos - self.cfg.window  # holds one of the last w positions
        rank = torch.where(protected, PROTECTED_RANK + first, rank)
        order = rank.argsort()
        n_out = int((counts[order].cumsum(0) < n_drop).sum()) + 1
        dropped = torch.zeros(n_chunks, dtype=torch.bool, device=pos.device)
        dropped[order[:n_out]] = True
        return dropped[inverse][None]


@register_policy("chunkkv")
def _make(**kwargs: Any) -> ChunkKVCache:
    return ChunkKVCache(**kwargs)
