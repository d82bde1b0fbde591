"""The full-KV teacher: one forward pass of the frozen model that records what training needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache.attention import chunk_causal_mask, gqa_attention
from ..cache.base import CachePolicy
from ..models.rope import Rope
from ..models.transformer import Transformer
from ..sekv.segmentation import token_surprisal


@dataclass
class TeacherRecord:
    """n_context context tokens followed by M query tokens.

    k, v: per layer [KV, T, D] pre-RoPE keys and values of every token (T = n_context + M);
    q: per layer [H, M, D] pre-RoPE queries of the query tokens; logits: [M, vocab] at the query
    tokens; surprisal: [n_context] -log p(token | past) of the context tokens (0 for the first);
    features: [F * H * D] mean pre-RoPE query of the first F layers over the context (Meta-Soft's
    selector input; None unless asked for)."""

    n_context: int
    query_ids: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q: list[torch.Tensor]
    logits: torch.Tensor
    surprisal: torch.Tensor
    features: torch.Tensor | None = None


class OnePassPolicy(CachePolicy):
    """A policy for one forward pass in training: nothing to roll back, nothing counted as a tier."""

    def _checkpoint(self) -> Any:
        return None

    def _restore(self, state: Any) -> None:
        return None

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        return []


class _RecordingCache(OnePassPolicy):
    """Exact causal attention over one chunk (the whole sequence) that keeps K, V and the last queries.
    Sliding-window layers (Gemma 3) attend within their window with their own RoPE, as the model does."""

    name = "teacher"
    supports_sliding_window = True

    def __init__(self, model: Transformer, rope: Rope, n_query: int, feature_layers: int = 0) -> None:
        super().__init__(model.config, rope)
        self.n_query = n_query
        self.feature_layers = feature_layers
        self.features: list[torch.Tensor] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.q: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k.append(k)
        self.v.append(v)
        self.q.append(q[:, -self.n_query:])
        if layer < self.feature_layers:
            self.features.append(q[:, : q.shape[1] - self.n_query].float().mean(dim=1))
        T = q.shape[1]
        rope, cos_sin = self.layer_rope(layer)
        return gqa_attention(rope.apply(q, self._positions, cos_sin), rope.apply(k, self._positions, cos_sin), v,
                             mask=chunk_causal_mask(T, T, window=self.config.window(layer)))


@torch.no_grad()
def run_teacher(model: Transformer, rope: Rope, context: list[int], query: list[int],
                feature_layers: int = 0) -> TeacherRecord:
    ids = torch.tensor(context + query, dtype=torch.long)
    cache = _RecordingCache(model, rope, len(query), feature_layers)
    cache.begin_chunk(torch.arange(len(ids)), is_prefill=True)
    logits = model(ids, cache, logits="all").float()
    surprisal = token_surprisal(logits[: len(context)], ids[: len(context)])
    return TeacherRecord(len(context), ids[len(context):], cache.k, cache.v, cache.q,
                         logits[len(context):], surprisal,
                         torch.stack(cache.features).flatten() if cache.features else None)
