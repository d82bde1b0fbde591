"""`metasoft` (Meta-Soft): learned soft tokens probe the context; dropped tokens merge into kept ones.

Prefill is chunked under a hard device budget (as `snapkv`): each layer holds at most C tokens in
tensors of that size. After every document chunk the k soft tokens (the library's vectors picked by
the selector from the document's features) run through the model as extra tokens at the positions
right after the chunk. In that probe pass they attend to the kept tokens and to each other; their
attention, summed over the soft tokens and averaged over each GQA group, then pooled over
neighbouring positions, scores every kept token. Their own K/V are never stored, and nothing of the
probe is visible to later tokens.

When a chunk (or a question, or a generated token) needs room, the lowest-scored tokens leave, sinks
and the recent window never do, and each leaving token is merged into its most similar kept token
(merge.py). Scores are question-agnostic: the ranking is fixed by the probe after the document's
last chunk; later tokens are unscored and outrank every document token, newest first.

Positions: every kept token keeps its original position (limited to the trained context, as
`snapkv`). Probe cost is reported in `observations()["probe_s"]`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..cache.attention import CausalBias, gqa_attention
from ..cache.base import CachePolicy, register_policy
from ..cache.budget import budget_tokens, resolve_budget_bytes
from ..cache.scoring import PROTECTED_RANK, UNSCORED_RANK, attend_in_parts, drop_lowest, pool_positions
from ..dtypes import CACHE_DTYPES
from ..errors import BudgetError, SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .config import MetaSoftConfig
from .library import SoftTokenLibrary
from .merge import MergedKV

#: slots freed at once when a few new tokens need room (amortizes merging over decode steps)
EVICT_BATCH = 16
#: runs the model over soft-token embeddings [k, n_embd] with this policy in probe mode
Prober = Callable[["MetaSoftCache", torch.Tensor], None]  # (policy, soft-token embeddings): one probe pass


class MetaSoftCache(CachePolicy):
    name = "metasoft"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, library: SoftTokenLibrary | None = None,
                 **options: Any) -> None:
        super().__init__(config, rope, device)
        try:
            self.cfg = MetaSoftConfig(**options)
        except TypeError as exc:
            raise SekvError(f"metasoft: {exc}") from None
        if library is None:
            raise SekvError("metasoft: needs its soft-token library (the torch engine supplies it)")
        per_layer = config.n_heads * config.head_dim
        if library.feature_dim % per_layer or not 1 <= library.feature_dim // per_layer <= config.n_layers:
            raise SekvError(f"metasoft: the soft-token library reads {library.feature_dim} features, which is not "
                            f"a whole number of this model's layers ({per_layer} each)")
        self.library = library
        self.feature_layers = library.feature_dim // per_layer
        self.prober: Prober | None = None
        self.budget_spec = budget
        self._causal = CausalBias(self.device)
        self._probing = False
        self.probe_s = 0.0
        self.probes = 0
        self.reserve(config.context_length)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        c = self.config
        return c.n_layers * MergedKV.bytes_per_token(c.n_kv_heads, c.head_dim, c.n_kv_heads, CACHE_DTYPES[self.cfg.dtype])

    @property
    def fixed_bytes(self) -> int:
        """The document-feature accumulator [feature_layers, H, D] f32."""
        return self.library.feature_dim * 4

    def min_tokens(self) -> int:
        return self.cfg.n_sink + self.cfg.recent + 16

    def reserve(self, n_tokens: int) -> None:
        if self.n_tokens:
            raise SekvError("metasoft: reserve() must come before the first token")
        budget_bytes = resolve_budget_bytes(self.budget_spec, self.config, n_tokens, self.name)
        self.layers: list[MergedKV] = []
        try:
            self.capacity = budget_tokens(max(budget_bytes - self.fixed_bytes, 0), self.token_bytes,
                                          self.min_tokens(), self.name)
        except BudgetError:
            raise BudgetError(f"metasoft: a budget of {budget_bytes / 2**20:.2f} MiB cannot hold the "
                              f"{self.min_tokens()} tokens it needs (sinks, recent window, 16 more; "
                              f"{self.token_bytes} bytes each). Raise --budget.") from None
        self.chunk_tokens = max(1, int(self.capacity * self.cfg.chunk_fraction))
        c, dt = self.config, CACHE_DTYPES[self.cfg.dtype]
        self.layers = [MergedKV(c.n_kv_heads, c.head_dim, self.capacity, dt, self.device) for _ in range(c.n_layers)]
        self.features = torch.zeros(self.feature_layers, c.n_heads, c.head_dim, device=self.device)
        self.feature_tokens = 0
        self.frozen = False

    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens

    def part_tokens(self) -> int:
        """Largest part of a chunk written at once (room for the protected tokens and older ones)."""
        protected = self.cfg.n_sink + self.cfg.recent
        return max(1, min(self.chunk_tokens, (self.capacity - protected) // 2))

    # -- the engine's calls -----------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._probing:
            return self._probe_attend(layer, q, k, v)
        if self._is_prefill and not self.frozen and layer < self.feature_layers:
            self.features[layer] += q.float().sum(dim=1)
        positions = self._positions
        q_rot = self.rope.apply(q, positions, self._cos_sin)
        k_rot = self.rope.apply(k, positions, self._cos_sin)
        return attend_in_parts(q_rot, k_rot, v, positions, self.part_tokens(),
                               lambda *part: self._attend_part(layer, *part))

    def _attend_part(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        store = self.layers[layer]
        n_new = positions.shape[0]
        n_drop = store.length + n_new - store.capacity
        if n_drop > 0:
            # a decode step needs one slot: free EVICT_BATCH at once so merging runs once per batch of steps
            n_drop = max(n_drop, min(EVICT_BATCH, store.length - self.cfg.n_sink - self.cfg.recent))
            drop = drop_lowest(self.rank(store, int(positions[0])), n_drop)
            if self.cfg.merge:
                store.merge_dropped(drop, self.cfg.balance)
            store.keep(~drop)
        store.append(k, v, positions, -1.0)  # -1 = not scored yet
        bias = self._causal(n_new, store.length)
        if self.cfg.count_bias:
            log_count = store.counts().log()[:, None, :]  # [KV, 1, S]
            bias = log_count if bias is None else bias.whole() + log_count
        return gqa_attention(q, store.keys(), store.values(), bias=bias)

    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        super().end_chunk(logits, token_ids)
        if self._is_prefill and not self.frozen:
            self.feature_tokens += int(token_ids.shape[0])
            self._probe()

    def finish_prefill(self) -> None:
        """The document is read: its last probe fixed the ranking (question-agnostic)."""
        self.frozen = True

    # -- probing ----------------------------------------------------------------------------------------
    def document_features(self) -> torch.Tensor | None:
        """Mean pre-RoPE query of the first layers' heads over the document so far, flattened."""
        if not self.feature_tokens:
            return None
        return (self.features / self.feature_tokens).flatten()

    def soft_tokens(self) -> torch.Tensor:
        """The soft-token embeddings [k, n_embd] for the document read so far."""
        return self.library.soft_tokens(self.document_features(), static=self.cfg.static).detach()

    def _probe(self) -> None:
        if self.prober is None:
            raise SekvError("metasoft: no probe pass available (this method runs on the torch engine)")
        start = time.perf_counter()
        embeddings = self.soft_tokens().to(self.device)
        saved = (self._positions, self._cos_sin, self._local_cos_sin, self._is_prefill)
        CachePolicy.begin_chunk(self, torch.arange(self.n_tokens, self.n_tokens + embeddings.shape[0],
                                                   device=self.device), is_prefill=False)
        self._probing = True
        try:
            self.prober(self, embeddings)
        finally:
            self._probing = False
            self._positions, self._cos_sin, self._local_cos_sin, self._is_prefill = saved
        self.probe_s += time.perf_counter() - start
        self.probes += 1

    def _probe_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Soft tokens q/k/v [H or KV, k, D] attend to the kept tokens and causally to each other; the
        kept tokens get their scores; nothing is stored."""
        store, positions = self.layers[layer], self._positions
        q_rot = self.rope.apply(q, positions, self._cos_sin).float()
        k_rot = self.rope.apply(k, positions, self._cos_sin).float()
        n, n_soft, dim = store.length, q.shape[1], q.shape[2]
        n_kv = store.k.shape[0]
        group = q.shape[0] // n_kv
        keys = torch.cat([store.keys().float(), k_rot], dim=1)  # [KV, n + k, D]
        values = torch.cat([store.values().float(), v.float()], dim=1)
        logits = q_rot.view(n_kv, group, n_soft, dim) @ keys[:, None].transpose(2, 3) * dim ** -0.5  # [KV, G, k, n+k]
        if self.cfg.count_bias:
            logits[..., :n] += store.counts().log()[:, None, None, :]
        later = torch.ones(n_soft, n_soft, dtype=torch.bool, device=q.device).triu(1)
        logits[..., n:] = logits[..., n:].masked_fill(later, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        votes = probs[..., :n].sum(dim=(1, 2)) / group  # [KV, n]
        store.score[:, :n] = pool_positions(votes, self.cfg.pool_kernel, self.cfg.pool)
        out = probs @ values[:, None]  # [KV, G, k, D]
        return out.reshape(q.shape[0], n_soft, dim).to(q.dtype)

    # -- ranking -------------------------------------------------------------------------------------
    def rank(self, store: MergedKV, next_pos: int) -> torch.Tensor:
        """Per-slot rank key [KV, n] (higher = kept longer): sinks and the recent window above all,
        unscored tokens above scored ones (both newest first), then the probe scores."""
        pos, score = store.positions().double(), store.scores().double()
        ranked = torch.where(score < 0, UNSCORED_RANK + pos, score)
        protected = (pos >= next_pos - self.cfg.recent) | (pos < self.cfg.n_sink)
        return torch.where(protected, PROTECTED_RANK + pos, ranked)

    # -- rollback and accounting ----------------------------------------------------------------------
    def _checkpoint(self) -> Any:
        return (self.n_tokens, self.frozen, self.features.clone(), self.feature_tokens,
                [s.snapshot() for s in self.layers])

    def _restore(self, mark: Any) -> None:
        self.n_tokens, self.frozen, features, self.feature_tokens, snaps = mark
        self.features.copy_(features)
        for store, snap in zip(self.layers, snaps):
            store.restore(snap)

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        return self.layers[layer].tensors() + ([self.features] if layer == 0 else [])

    def observations(self) -> dict[str, Any]:
        return {"probe_s": round(self.probe_s, 4), "probes": self.probes,
                "soft_tokens": self.library.n_soft, "merge": self.cfg.merge}


@register_policy("metasoft")
def _make(**kwargs: Any) -> MetaSoftCache:
    """`metasoft` (Meta-Soft): soft tokens probe the document; dropped tokens merge into similar kept ones."""
    return MetaSoftCache(**kwargs)
