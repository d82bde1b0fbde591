"""`snapkv`: keep the keys that an observation window of recent queries attends to (SnapKV).

Scores (as in the paper): the last `window` queries fed attend to the kept keys; per query head the
attention probabilities are summed over the window's queries, averaged over the query heads of each
KV group, and pooled over neighbouring positions (avg, kernel 5). Each KV head keeps its own top
tokens ([KV, C, D] with per-head positions) plus the window itself.

Under chunked prefill with a hard device budget the document's full KV never exists, so the
selection runs as a *streaming SnapKV*:

* per layer the cache holds at most C tokens in tensors of that size (C from the budget);
* a chunk is written after making room for it: the tokens with the lowest scores are evicted, the
  last `window` tokens fed (the current observation window) are never evicted;
* after every prefill chunk (part) the window - the last `window` queries fed, kept in a small
  rolling buffer that may span chunks - re-scores every kept key: the new chunk's keys and the older
  ones alike. Scores from one window are comparable with each other, scores from different windows
  are not, so older keys are re-scored rather than keeping their old values. The window's attention
  is computed over the kept keys in blocks (`scoring.attention_scores`); there is no [T, T] matrix.
* `finish_prefill()` makes the final selection with the true observation window, the last `window`
  tokens fed. The selection is lazy: it fixes the ranking, and tokens leave in rank order only when
  later tokens need room, so at a device budget of C a document is kept as SnapKV at budget
  C - (tokens of the conversation so far) would keep it.

`question_aware` (reported with every result):
* False (default, question-agnostic): the ranking is frozen at the first `finish_prefill()` (the end
  of the document: the window is the document's last `window` tokens). Question and answer tokens
  are not scored; they outrank every document token (newest first) and displace the lowest-ranked
  document tokens when room is needed.
* True (question-aware): prefill chunks keep re-scoring after the document, so the question turn's
  window (its last `window` tokens, the question itself) re-ranks the kept document tokens at the
  `finish_prefill()` after the question; decoded tokens are not scored. Tokens evicted to make room
  for the question itself were ranked by the document's window (the budget holds during the
  question too).

Positions: every token keeps its original position (as `streaming` does). Pooling runs over the
kept tokens in position order (neighbours are the nearest kept tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import BudgetError, SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .attention import CausalBias, gqa_attention
from .base import CachePolicy, register_policy
from .budget import budget_tokens, resolve_budget_bytes
from .scoring import (PROTECTED_RANK, UNSCORED_RANK, ScoredKV, attend_in_parts, attention_scores, drop_lowest,
                      pool_positions)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SnapKVConfig:
    """window: observation window w (32 in the paper, 64 in kvpress); pool_kernel / pool: 1-D pooling
    of the scores over positions (avg 5 in the paper; some harnesses use max 7); question_aware: see
    the module doc; chunk_fraction: share of the per-layer budget one prefill chunk may take; dtype:
    storage type of the kept K/V."""

    method: ClassVar[str] = "snapkv"

    window: int = 32
    pool_kernel: int = 5
    pool: str = "avg"
    question_aware: bool = False
    chunk_fraction: float = 0.25
    dtype: str = "f16"

    def __post_init__(self) -> None:
        name = self.method
        if not is_int(self.window) or self.window < 1:
            raise SekvError(f"{name}: window must be an integer >= 1, got {self.window!r}")
        if not is_int(self.pool_kernel) or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise SekvError(f"{name}: pool_kernel must be an odd integer >= 1, got {self.pool_kernel!r}")
        if self.pool not in ("avg", "max"):
            raise SekvError(f"{name}: pool must be 'avg' or 'max', got '{self.pool}'")
        if not isinstance(self.question_aware, bool):
            raise SekvError(f"{name}: question_aware must be true or false, got {self.question_aware!r}")
        if not is_number(self.chunk_fraction) or not 0 < self.chunk_fraction < 1:
            raise SekvError(f"{name}: chunk_fraction must be in (0, 1), got {self.chunk_fraction!r}")
        check_cache_dtype(name, self.dtype)


class SnapKVCache(CachePolicy):
    name = "snapkv"
    config_class: type = SnapKVConfig
    #: True: all KV heads of a layer keep the same tokens (one row of positions/scores per layer)
    shared_rows = False

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        try:
            self.cfg = self.config_class(**options)
        except TypeError as exc:
            raise SekvError(f"{self.name}: {exc}") from None
        self.budget_spec = budget
        self._causal = CausalBias(self.device)
        self.reserve(config.context_length)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return 1 if self.shared_rows else self.config.n_kv_heads

    @property
    def token_bytes(self) -> int:
        """Device bytes per kept token over all layers: K, V, and per row a position and a score."""
        c = self.config
        return c.n_layers * ScoredKV.bytes_per_token(c.n_kv_heads, c.head_dim, self.rows, CACHE_DTYPES[self.cfg.dtype])

    @property
    def window_bytes(self) -> int:
        """The rolling observation window of every layer: queries [H, w, D] f32 and positions [w] int64."""
        c, w = self.config, self.cfg.window
        return c.n_layers * (c.n_heads * w * c.head_dim * 4 + w * 8)

    def min_tokens(self) -> int:
        return self.cfg.window + 16

    def layer_capacities(self, capacity: int, planned_tokens: int) -> list[int]:
        """Tokens each layer keeps (`planned_tokens`: the length the budget was sized for); SnapKV:
        the same in every layer."""
        return [capacity] * self.config.n_layers

    def part_tokens(self, layer: int) -> int:
        """Largest part of a chunk that layer `layer` takes at once (room for the window and older tokens)."""
        cap = self.layers[layer].capacity
        return max(1, min(self.chunk_tokens, (cap - self.cfg.window) // 2))

    def reserve(self, n_tokens: int) -> None:
        if self.n_tokens:
            raise SekvError(f"{self.name}: reserve() must come before the first token")
        budget_bytes = resolve_budget_bytes(self.budget_spec, self.config, n_tokens, self.name)
        self.layers: list[ScoredKV] = []  # free the previous allocation first
        self.win_q: list[torch.Tensor] = []
        #: tokens per layer of the uniform (SnapKV) allocation; the layers hold n_layers * capacity in all
        try:
            self.capacity = budget_tokens(max(budget_bytes - self.window_bytes, 0), self.token_bytes,
                                          self.min_tokens(), self.name)
        except BudgetError as exc:
            raise BudgetError(f"{exc} (the observation windows take {self.window_bytes / 2**20:.2f} MiB "
                              f"of the {budget_bytes / 2**20:.2f} MiB budget)") from None
        self.chunk_tokens = max(1, int(self.capacity * self.cfg.chunk_fraction))
        c, w, dt = self.config, self.cfg.window, CACHE_DTYPES[self.cfg.dtype]
        self.layers = [ScoredKV(c.n_kv_heads, c.head_dim, cap, self.rows, dt, self.device)
                       for cap in self.layer_capacities(self.capacity, n_tokens)]
        self.win_q = [torch.zeros(c.n_heads, w, c.head_dim, device=self.device) for _ in range(c.n_layers)]
        self.win_pos = [torch.full((w,), -1, dtype=torch.long, device=self.device) for _ in range(c.n_layers)]
        self.win_len = [0] * c.n_layers
        self.frozen = False  # question-agnostic: ranking fixed at the end of the document
        self.stale = False  # tokens were added since the window last scored
        self._scoring = False

    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens

    # -- the engine's calls ------------------------------------------------------------------------
    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        super().begin_chunk(positions, is_prefill)
        self._scoring = is_prefill and not self.frozen
        self.stale = not self._scoring

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        positions = self._positions
        q_rot = self.rope.apply(q, positions, self._cos_sin)
        k_rot = self.rope.apply(k, positions, self._cos_sin)
        return attend_in_parts(q_rot, k_rot, v, positions, self.part_tokens(layer),
                               lambda *part: self._attend_part(layer, *part))

    def _attend_part(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        store = self.layers[layer]
        n_new = positions.shape[0]
        n_drop = store.length + n_new - store.capacity
        if n_drop > 0:
            store.keep(~self.drop_mask(store, n_drop, int(positions[0])))
        store.append(k, v, positions, -1.0)  # -1 = not scored yet
        out = gqa_attention(q, store.keys(), store.values(), bias=self._causal(n_new, store.length))  # chunk after every kept token
        self._push_window(layer, q, positions)
        if self._scoring:
            self._rescore(layer)
        return out

    def finish_prefill(self) -> None:
        """Final selection with the true observation window (the last `window` tokens fed)."""
        if self.frozen:
            return
        if self.stale:
            for layer in range(self.config.n_layers):
                self._rescore(layer)
            self.stale = False
        if not self.cfg.question_aware:
            self.frozen = True

    # -- scoring and eviction ----------------------------------------------------------------------
    def _push_window(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the last `window` post-RoPE queries fed (they may come from several chunks)."""
        w, buf, pos, m = self.cfg.window, self.win_q[layer], self.win_pos[layer], self.win_len[layer]
        t = q.shape[1]
        if t >= w:
            buf.copy_(q[:, -w:])
            pos.copy_(positions[-w:])
            self.win_len[layer] = w
            return
        keep = min(m, w - t)
        buf[:, : keep + t] = torch.cat([buf[:, m - keep: m], q.float()], dim=1)
        pos[: keep + t] = torch.cat([pos[m - keep: m], positions])
        self.win_len[layer] = keep + t

    def window_votes(self, layer: int) -> torch.Tensor:
        """SnapKV scores [KV, n] of the kept keys: window attention summed over the window's queries,
        averaged over each GQA group, pooled over positions."""
        store, m = self.layers[layer], self.win_len[layer]
        _, received = attention_scores(self.win_q[layer][:, :m], store.keys(), self.win_pos[layer][:m],
                                       store.positions())
        votes = received / self.config.group_size
        return pool_positions(votes, self.cfg.pool_kernel, self.cfg.pool)

    def _rescore(self, layer: int) -> None:
        store = self.layers[layer]
        if store.length and self.win_len[layer]:
            votes = self.window_votes(layer)
            store.score[:, : store.length] = votes.sum(0, keepdim=True) if self.shared_rows else votes

    def rank(self, store: ScoredKV, next_pos: int) -> torch.Tensor:
        """Per-slot rank key [P, n] (higher = kept longer): the window above everything, unscored
        tokens above scored ones (both newest first), then the scores."""
        pos, score = store.positions().double(), store.scores().double()
        ranked = torch.where(score < 0, UNSCORED_RANK + pos, score)
        return torch.where(pos >= next_pos - self.cfg.window, PROTECTED_RANK + pos, ranked)

    def drop_mask(self, store: ScoredKV, n_drop: int, next_pos: int) -> torch.Tensor:
        """Slots to evict [P, n] so that at least n_drop leave (exactly n_drop per KV head here)."""
        return drop_lowest(self.rank(store, next_pos), n_drop)

    # -- rollback and accounting -----------------------------------------------------------------------
    def _checkpoint(self) -> Any:
        """A snapshot in host memory (eviction compacts the tensors in place)."""
        windows = [(q[:, :m].cpu().clone(), p[:m].cpu().clone(), m)
                   for q, p, m in zip(self.win_q, self.win_pos, self.win_len)]
        return (self.n_tokens, self.frozen, self.stale, [s.snapshot() for s in self.layers], windows)

    def _restore(self, mark: Any) -> None:
        self.n_tokens, self.frozen, self.stale, snaps, windows = mark
        for store, snap in zip(self.layers, snaps):
            store.restore(snap)
        for layer, (q, p, m) in enumerate(windows):
            self.win_q[layer][:, :m].copy_(q)
            self.win_pos[layer][:m].copy_(p)
            self.win_pos[layer][m:] = -1
            self.win_len[layer] = m

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        return self.layers[layer].tensors() + [self.win_q[layer], self.win_pos[layer]]


@register_policy("snapkv")
def _make(**kwargs: Any) -> SnapKVCache:
    return SnapKVCache(**kwargs)
