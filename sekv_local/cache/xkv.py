"""`xkv`: cross-layer SVD of the KV cache with selective reconstruction (docs/DESIGN.md §6, §8).

For each window of G adjacent layers the pre-RoPE keys of all its KV heads are concatenated along
features, X_k [T, G*KV*D], and kept as X_k ~= A_k B_k: a token basis A_k [T, r_k] shared by the G
layers and one reconstruction block per layer (the layer's columns of B_k [r_k, G*KV*D]). Values
likewise with their own rank r_v. Everything lives in the device tier: this is the compressed cache.

Chunked prefill, incrementally: one basis per window for the whole document. A new chunk X is
absorbed by an SVD of [diag(sigma) B; X] (the old rows enter through their singular values), which
gives the new basis B'; old coefficients are re-expressed as A (B B'^T) and the new rows as X B'^T.
Factoring each chunk separately would instead pay a block of r x G*KV*D per chunk, which at chunk
sizes a small budget allows costs more than the token basis itself and penalises exactly the large
windows (G) the method is about.

Decode (one query token): chunk landmarks (mean post-RoPE key of each `landmark_chunk` tokens, per
layer and KV head) score the compressed chunks; only the top chunks' rows are rebuilt (then RoPE),
next to exact rows: outlier chunks (tokens least like their own landmark), the local window and the
tokens since the last compression (question, generated). `reconstruct="dense"` rebuilds every row
instead, for comparison. Multi-token chunks (prefill, a question) attend to all compressed rows,
rebuilt block by block and merged by log-sum-exp, so the working set stays one block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import BudgetError, SekvError, config_check, reject_unknown
from ..models.config import ModelConfig
from ..models.rope import Rope
from ..sekv.buffers import RowBuffer, VecBuffer
from .attention import attention_with_lse, gqa_attention_parts, merge_attention
from .base import CachePolicy, register_policy, storage_bytes

_ROW_STEP = 32  # growth step of row buffers (their slack counts against the budget)
_DECODE_SLACK = 64  # exact tokens allowed past the local window before they are compressed
_PREFILL_BLOCK = 512  # compressed rows rebuilt at once for multi-token chunks
_KEPT_MARKS = 4  # rollback points kept restorable (the session keeps one: after the document)


@dataclass(frozen=True)
class XkvConfig:
    """xKV settings.

    group: G, adjacent layers sharing one token basis (1 = single-layer SVD; a last window may be smaller).
    v_share: fraction of the rank budget given to values (the authors' 144/240 at G=1: V needs more).
    rank_k, rank_v: fixed ranks per window; 0 derives both from the device budget (:func:`derive_ranks`).
    landmark_chunk: tokens per landmark chunk (selection granularity).
    local_chunks: most recent chunks kept exact.
    select_tokens: rows rebuilt per decode step, layer and KV head (selective reconstruction).
    outlier_fraction: fraction of compressed chunks per layer and KV head kept exact (least like their landmark).
    reconstruct: "selective" or "dense" (rebuild every compressed row at each decode step).
    dtype: storage type of factors and exact rows.
    """

    group: int = 2
    v_share: float = 0.6
    rank_k: int = 0
    rank_v: int = 0
    landmark_chunk: int = 8
    local_chunks: int = 4
    select_tokens: int = 256
    outlier_fraction: float = 0.02
    reconstruct: str = "selective"
    dtype: str = "f16"

    def __post_init__(self) -> None:
        need = config_check("xkv")

        need(self.group >= 1, "group must be >= 1")
        need(0 < self.v_share < 1, "v_share must be in (0, 1)")
        need(self.rank_k >= 0 and self.rank_v >= 0, "ranks must be >= 0 (0 = from the budget)")
        need((self.rank_k == 0) == (self.rank_v == 0), "set both rank_k and rank_v, or neither")
        need(self.landmark_chunk >= 1, "landmark_chunk must be >= 1")
        need(self.local_chunks >= 1, "local_chunks must be >= 1")
        need(self.select_tokens >= self.landmark_chunk, "select_tokens must be >= landmark_chunk")
        need(0 <= self.outlier_fraction < 1, "outlier_fraction must be in [0, 1)")
        need(self.reconstruct in ("selective", "dense"), "reconstruct must be 'selective' or 'dense'")
        check_cache_dtype("xkv", self.dtype)


def factor_rank(values: int, tokens: int, layers: int, group: int, kv_dim: int) -> int:
    """The largest rank r whose factors fit `values` numbers: W = ceil(layers / G) windows each store
    A [T, r] and B [r, g_w * kv_dim], r * (W * T + layers * kv_dim) numbers in all."""
    return values // (-(-layers // group) * tokens + layers * kv_dim)


def derive_ranks(factor_bytes: int, tokens: int, layers: int, group: int, kv_dim: int, itemsize: int,
                 v_share: float) -> tuple[int, int]:
    """Ranks (r_k, r_v) whose factors fit `factor_bytes` for a context of `tokens`.

    Window w (g_w layers, g_w * kv_dim features) stores A [T, r] and B [r, g_w * kv_dim] for K and V, so
    all windows together take (r_k + r_v) * itemsize * (W * T + layers * kv_dim) bytes, W = ceil(layers / G).
    The rank sum is the largest that fits; V gets `v_share` of it. For long contexts the factors alone
    compress by 2 * G * kv_dim / (r_k + r_v) (e.g. G=4, kv_dim=192, r_k+r_v=192: 8x).
    """
    total = min(factor_rank(factor_bytes // itemsize, tokens, layers, group, kv_dim), 2 * group * kv_dim)
    r_v = int(round(total * v_share))
    return int(total - r_v), r_v


class _WindowFactors:
    """Incremental truncated SVD X ~= A B of one window's K (or V): A [T, r] (rows grow), B [r, F]
    orthonormal rows, sigma [r] the singular values that carry the old rows into the next update."""

    def __init__(self, rank: int, features: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rank = min(rank, features)
        self.a = RowBuffer(1, self.rank, dtype, device, _ROW_STEP)
        self.b = torch.zeros(self.rank, features, dtype=dtype, device=device)
        self.sigma = torch.zeros(self.rank, dtype=torch.float32, device=device)

    def absorb(self, x: torch.Tensor) -> None:
        """Append rows x [n, F] (float32)."""
        b_old = self.b.float()
        stacked = torch.cat([self.sigma[:, None] * b_old, x.float()])  # [r + n, F]
        _, s, vh = torch.linalg.svd(stacked, full_matrices=False)
        r = min(self.rank, vh.shape[0])
        b_new = torch.zeros_like(b_old)
        b_new[:r] = vh[:r]
        if self.a.length:
            rotate = b_old @ b_new.T  # [r, r]: old coefficients in the new basis
            self.a.data[0, : self.a.length] = (self.a.view()[0].float() @ rotate).to(self.a.data.dtype)
        self.a.append((x.float() @ b_new.T)[None])
        self.b = b_new.to(self.b.dtype)
        self.sigma = torch.zeros_like(self.sigma)
        self.sigma[:r] = s[:r]

    def truncate(self, n: int) -> None:
        self.a.truncate(n)

    def tensors(self) -> list[torch.Tensor]:
        return [self.a.data, self.b, self.sigma]

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a.view().cpu().clone(), self.b.cpu().clone(), self.sigma.cpu().clone()

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        a, b, sigma = snap
        self.a.load(a.to(self.a.data.device))
        self.b = b.to(self.b.device)
        self.sigma = sigma.to(self.sigma.device)


@dataclass
class _Layer:
    pend_k: RowBuffer  # post-RoPE exact rows not compressed yet [KV, P, D]
    pend_v: RowBuffer
    landmark: RowBuffer  # mean post-RoPE key per compressed chunk [KV, C, D]
    out_k: RowBuffer  # exact rows of outlier chunks [KV, n_out * c, D] (post-RoPE)
    out_v: RowBuffer
    out_ids: RowBuffer  # chunk index of each outlier [KV, n_out, 1]


class XkvCache(CachePolicy):
    name = "xkv"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = 0.25, **options: Any) -> None:
        super().__init__(config, rope, device)
        self.cfg = XkvConfig(**_known(options))
        if budget is None:
            budget = 0.25
        if isinstance(budget, float) and not 0 < budget <= 1:
            raise SekvError(f"xkv: a fractional budget must be in (0, 1], got {budget}")
        self.budget_spec = budget
        self.dtype = CACHE_DTYPES[self.cfg.dtype]
        KV, D, dev, dt = config.n_kv_heads, config.head_dim, self.device, self.dtype
        self.layers = [_Layer(*(RowBuffer(KV, D, dt, dev, _ROW_STEP) for _ in range(5)),
                              RowBuffer(KV, 1, torch.long, dev, _ROW_STEP)) for _ in range(config.n_layers)]
        G = self.cfg.group
        self.windows = [list(range(s, min(s + G, config.n_layers))) for s in range(0, config.n_layers, G)]
        self.comp_pos = VecBuffer(torch.long, dev, _ROW_STEP)  # positions of compressed rows (set before _plan)
        self.pend_pos = VecBuffer(torch.long, dev, _ROW_STEP)
        self._to_compress = 0
        self._work_bytes = 0
        self._marks: list[dict[str, Any]] = []
        self._outlier_debt = 0.0
        self._outlier_quota = 0
        self.planned_tokens = config.context_length
        self.factors: list[tuple[_WindowFactors, _WindowFactors]] = []  # planned by reserve() or the first chunk

    # -- budget ------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """Device bytes of one exact token in one layer (K and V)."""
        return 2 * self.config.n_kv_heads * self.config.head_dim * self.dtype.itemsize

    def reserve(self, n_tokens: int) -> None:
        self.planned_tokens = max(int(n_tokens), 1)
        self._plan()

    def _plan(self) -> None:
        cfg, c = self.cfg, self.config
        T, L, KV, D = self.planned_tokens, c.n_layers, c.n_kv_heads, c.head_dim
        full = c.full_kv_bytes(T)
        self.budget_bytes = int(self.budget_spec * full) if isinstance(self.budget_spec, float) else int(self.budget_spec)
        size = self.dtype.itemsize
        chunks = -(-T // cfg.landmark_chunk)
        self.local = cfg.local_chunks * cfg.landmark_chunk
        outliers = math.ceil(cfg.outlier_fraction * chunks) + 1
        # pending rows between chunks: local window + decode slack + a partial landmark chunk, rounded up to
        # the buffers' growth step (they are shrunk back after each compression)
        pending = -(-(self.local + _DECODE_SLACK + cfg.landmark_chunk) // _ROW_STEP) * _ROW_STEP
        exact = pending * L * self.token_bytes \
            + outliers * cfg.landmark_chunk * L * self.token_bytes + outliers * L * KV * 8
        landmarks = (chunks + _ROW_STEP) * L * KV * D * size
        positions = (T + self.local + _DECODE_SLACK + 4 * _ROW_STEP) * 8
        work = 2 * KV * max(cfg.select_tokens, _PREFILL_BLOCK) * D * 4  # one layer's rebuilt K and V, float32
        self.chunk_tokens = 1024
        while True:  # the prefill chunk is exact for at most one window's layers at a time
            transient = len(self.windows[0]) * self.chunk_tokens * self.token_bytes
            fixed = exact + landmarks + positions + work + transient
            if fixed <= 0.5 * self.budget_bytes or self.chunk_tokens <= 64:
                break
            self.chunk_tokens //= 2
        if cfg.rank_k:
            self.rank_k, self.rank_v = cfg.rank_k, cfg.rank_v
        else:
            # the factor rows grow in _ROW_STEP steps: plan for the rounded-up length
            self.rank_k, self.rank_v = derive_ranks(self.budget_bytes - fixed, T + _ROW_STEP, L, cfg.group, KV * D,
                                                    size, cfg.v_share)
        self.fixed_bytes = fixed
        if min(self.rank_k, self.rank_v) < 2:
            need = fixed + 4 * size * (len(self.windows) * T + L * KV * D)
            raise BudgetError(
                f"xkv: a budget of {self.budget_bytes / 2**20:.1f} MiB ({self.budget_bytes / full:.1%} of full KV for "
                f"{T} tokens) leaves no room for factors: landmarks, exact rows and the working set take "
                f"{fixed / 2**20:.1f} MiB. Use a budget of at least {need / full:.0%} (e.g. --budget "
                f"{min(1.0, 1.25 * need / full):.2f}).")
        if self.comp_pos.length:
            raise SekvError("xkv: reserve() after compression started would drop the factors")
        KVD = KV * D
        self.factors = [(_WindowFactors(self.rank_k, len(w) * KVD, self.dtype, self.device),
                         _WindowFactors(self.rank_v, len(w) * KVD, self.dtype, self.device)) for w in self.windows]

    def max_chunk_tokens(self) -> int:
        self._ensure_plan()
        return self.chunk_tokens

    def _ensure_plan(self) -> None:
        if not self.factors:
            self._plan()

    # -- attention ---------------------------------------------------------------------------------
    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        self._ensure_plan()
        super().begin_chunk(positions, is_prefill)
        self.pend_pos.append(positions)
        # rows to compress at the end of this chunk (each window does it after its last layer has
        # attended): everything but the local window, whole landmark chunks only
        excess = self.pend_pos.length - self.local
        slack = 0 if is_prefill and positions.shape[0] > 1 else _DECODE_SLACK
        c = self.cfg.landmark_chunk
        self._to_compress = (excess // c) * c if excess > slack else 0
        # outlier chunks per layer and KV head for this compression; the fraction's remainder carries over
        self._outlier_debt += self.cfg.outlier_fraction * self._to_compress / c
        self._outlier_quota = int(self._outlier_debt)
        self._outlier_debt -= self._outlier_quota

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        L = self.layers[layer]
        L.pend_k.append(self.rope.apply(k, self._positions, self._cos_sin))
        L.pend_v.append(v)
        q_rot = self.rope.apply(q, self._positions, self._cos_sin)
        KV, T = self.config.n_kv_heads, q.shape[1]
        pend_pos = self.pend_pos.view()
        keys = [L.pend_k.view().float()]
        values = [L.pend_v.view().float()]
        causal = torch.where(pend_pos[None, :] <= self._positions[:, None], 0.0, float("-inf"))  # [T, P]
        biases = [causal[None].expand(KV, T, -1)]
        if L.out_k.length:
            keys.append(L.out_k.view().float())
            values.append(L.out_v.view().float())
            biases.append(torch.zeros(KV, T, L.out_k.length))
        n_comp = self.comp_pos.length
        if n_comp and T == 1 and self.cfg.reconstruct == "selective":
            rows = self._select(layer, q_rot)  # [KV, n] token indices
            zk, zv = self._rebuild(layer, rows)
            keys.append(self._rotate(zk, self.comp_pos.view()[rows]))
            values.append(zv)
            biases.append(torch.zeros(KV, T, rows.shape[1]))
            self._work_bytes = max(self._work_bytes, storage_bytes(zk, zv))
            out = gqa_attention_parts(q_rot, keys, values, biases)
        elif n_comp:
            parts = [attention_with_lse(q_rot, torch.cat(keys, 1), torch.cat(values, 1), torch.cat(biases, 2))]
            skip = self._outlier_row_mask(layer)  # exact copies of outlier rows exist: their rebuilt rows drop out
            for start in range(0, n_comp, _PREFILL_BLOCK):  # bounded working set, not a loop over tokens
                rows = torch.arange(start, min(start + _PREFILL_BLOCK, n_comp), device=self.device).expand(KV, -1)
                zk, zv = self._rebuild(layer, rows)
                self._work_bytes = max(self._work_bytes, storage_bytes(zk, zv))
                bias = torch.where(skip[:, rows[0]], float("-inf"), 0.0)[:, None, :]
                parts.append(attention_with_lse(q_rot, self._rotate(zk, self.comp_pos.view()[rows]), zv, bias))
            out = merge_attention(parts)
        else:
            out = gqa_attention_parts(q_rot, keys, values, biases)
        window = self._window_of(layer)
        if self._to_compress and layer == self.windows[window][-1]:
            self._note_peak(extra=self._work_bytes)  # the window's exact chunk rows are at their peak here
            self._compress_window(window)
        return out.to(q.dtype)

    def _window_of(self, layer: int) -> int:
        return layer // self.cfg.group

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on pre-RoPE rows x [KV, n, D] at positions [KV, n]."""
        cos, sin = self.rope.cos_sin(positions.reshape(-1))
        cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        return self.rope.apply(x, positions, (cos, sin))

    def _outlier_row_mask(self, layer: int) -> torch.Tensor:
        """[KV, n_comp] True where a compressed row belongs to an outlier chunk of this layer."""
        L, c = self.layers[layer], self.cfg.landmark_chunk
        chunk_is_out = torch.zeros(self.config.n_kv_heads, L.landmark.length, dtype=torch.bool, device=self.device)
        if L.out_ids.length:
            chunk_is_out.scatter_(1, L.out_ids.view()[..., 0], True)
        return chunk_is_out.repeat_interleave(c, dim=1)[:, : self.comp_pos.length]

    def _select(self, layer: int, q_rot: torch.Tensor) -> torch.Tensor:
        """Token rows [KV, n] of the top chunks per KV head by landmark score (softmax over chunks,
        max over the GQA group), outlier chunks excluded (they are exact)."""
        L, c = self.layers[layer], self.cfg.landmark_chunk
        KV = self.config.n_kv_heads
        G = q_rot.shape[0] // KV
        marks = L.landmark.view().float().repeat_interleave(G, dim=0)  # [H, C, D]
        probs = torch.softmax(q_rot @ marks.transpose(1, 2) / math.sqrt(q_rot.shape[-1]), dim=-1)  # [H, 1, C]
        score = probs.view(KV, G, -1).amax(dim=1)
        if L.out_ids.length:
            score = score.scatter(1, L.out_ids.view()[..., 0], -1.0)
        n = min(self.cfg.select_tokens // c, score.shape[1])
        top = torch.topk(score, n, dim=-1).indices  # [KV, n]
        rows = (top[..., None] * c + torch.arange(c, device=self.device)).view(KV, -1)
        return rows

    def _rebuild(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE K and V rows [KV, n, D] (float32) of token indices rows [KV, n] from the window's factors."""
        window = self._window_of(layer)
        j = layer - self.windows[window][0]
        KV, D = self.config.n_kv_heads, self.config.head_dim
        fk, fv = self.factors[window]
        out = []
        for f in (fk, fv):
            coeff = f.a.view()[0][rows].float()  # [KV, n, r]
            block = f.b[:, j * KV * D:(j + 1) * KV * D].float().view(-1, KV, D).transpose(0, 1)  # [KV, r, D]
            out.append(coeff @ block)
            # the host reads the rows' coefficients (each row's once, shared by the heads) and the layer's block
            self._count_host_read((rows.unique().numel() * coeff.shape[-1] + block.numel()) * f.a.data.element_size())
        return out[0], out[1]

    # -- compression -------------------------------------------------------------------------------
    def _compress_window(self, window: int) -> None:
        """Fold the oldest `_to_compress` pending rows of the window's layers into its factors."""
        n, c = self._to_compress, self.cfg.landmark_chunk
        layers = self.windows[window]
        pos = self.pend_pos.view()[:n]
        unrotate = self.rope.cos_sin(-pos)
        keys_pre, values = [], []
        for layer in layers:  # G <= 4 layers of one window
            L = self.layers[layer]
            k_post = L.pend_k.view()[:, :n].float()
            keys_pre.append(self.rope.apply(k_post, -pos, unrotate))
            values.append(L.pend_v.view()[:, :n].float())
            self._add_landmarks_and_outliers(L, k_post, values[-1])
            L.pend_k.drop_front(n)
            L.pend_v.drop_front(n)
            L.pend_k.shrink()  # the chunk's exact rows must not outlive it as allocated capacity
            L.pend_v.shrink()
        self._snapshot_for_marks()
        fk, fv = self.factors[window]
        # [G, KV, n, D] -> [n, G*KV*D]: features ordered layer, head, dim
        fk.absorb(torch.stack(keys_pre).permute(2, 0, 1, 3).reshape(n, -1))
        fv.absorb(torch.stack(values).permute(2, 0, 1, 3).reshape(n, -1))

    def _add_landmarks_and_outliers(self, L: _Layer, k_post: torch.Tensor, v: torch.Tensor) -> None:
        KV, n, D = k_post.shape
        c = self.cfg.landmark_chunk
        chunks = k_post.view(KV, n // c, c, D)
        mean = chunks.mean(dim=2)  # [KV, C_new, D]
        first_chunk = L.landmark.length
        L.landmark.append(mean)
        quota = min(self._outlier_quota, n // c)
        if quota <= 0:
            return
        cos = torch.nn.functional.cosine_similarity(chunks, mean[:, :, None, :], dim=-1).amin(dim=-1)  # [KV, C_new]
        ids = torch.topk(-cos, quota, dim=-1).indices  # least like their landmark
        rows = (ids[..., None] * c + torch.arange(c, device=self.device)).view(KV, -1)
        L.out_k.append(torch.gather(k_post, 1, rows[..., None].expand(-1, -1, D)))
        L.out_v.append(torch.gather(v, 1, rows[..., None].expand(-1, -1, D)))
        L.out_ids.append((ids + first_chunk)[..., None])

    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        self.n_tokens += int(token_ids.shape[0])
        self._note_peak(extra=self._work_bytes)
        self._work_bytes = 0
        if self._to_compress:
            self.comp_pos.append(self.pend_pos.view()[: self._to_compress])
            self.pend_pos.drop_front(self._to_compress)
            self._to_compress = 0
        self._note_peak()

    # -- rollback ----------------------------------------------------------------------------------
    def _checkpoint(self) -> dict[str, Any]:
        mark = {"n_tokens": self.n_tokens, "comp": self.comp_pos.length, "snapshot": None,
                "pend_pos": self.pend_pos.view().clone(),
                "layers": [(l.pend_k.view().clone(), l.pend_v.view().clone(), l.landmark.length, l.out_k.length,
                            l.out_ids.length) for l in self.layers],
                "outlier_debt": self._outlier_debt}
        self._marks = self._marks[-(_KEPT_MARKS - 1):] + [mark]
        return mark

    def _checkpoint_states(self) -> list[Any]:
        return super()._checkpoint_states() + self._marks  # the last marks stay here until rolled back to

    def _snapshot_for_marks(self) -> None:
        """Compression after a mark rotates every old coefficient row: keep the factors as they were
        (host RAM, once per mark) so rollback can restore them."""
        waiting = [m for m in self._marks if m["snapshot"] is None]
        if waiting:
            snap = [(fk.snapshot(), fv.snapshot()) for fk, fv in self.factors]
            for m in waiting:
                m["snapshot"] = snap

    def _restore(self, mark: dict[str, Any]) -> None:
        self.n_tokens = mark["n_tokens"]
        self.comp_pos.truncate(mark["comp"])
        self.pend_pos.truncate(0)
        self.pend_pos.append(mark["pend_pos"])
        self._outlier_debt = mark["outlier_debt"]
        for layer, (pk, pv, n_land, n_out, n_ids) in zip(self.layers, mark["layers"]):
            layer.pend_k.truncate(0)
            layer.pend_k.append(pk)
            layer.pend_v.truncate(0)
            layer.pend_v.append(pv)
            layer.landmark.truncate(n_land)
            layer.out_k.truncate(n_out)
            layer.out_v.truncate(n_out)
            layer.out_ids.truncate(n_ids)
        if mark["snapshot"] is not None:
            for (fk, fv), (sk, sv) in zip(self.factors, mark["snapshot"]):
                fk.restore(sk)
                fv.restore(sv)
        if not any(m is mark for m in self._marks):
            self._marks = self._marks[-(_KEPT_MARKS - 1):] + [mark]

    # -- persistence -------------------------------------------------------------------------------
    _LAYER = ("pend_k", "pend_v", "landmark", "out_k", "out_v", "out_ids")

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self._ensure_plan()
        tensors = {"comp_pos": self.comp_pos.view(), "pend_pos": self.pend_pos.view()}
        for i, layer in enumerate(self.layers):
            tensors.update({f"L{i}.{name}": getattr(layer, name).view() for name in self._LAYER})
        for w, pair in enumerate(self.factors):
            for kind, f in zip("kv", pair):
                tensors.update({f"W{w}.{kind}.a": f.a.view(), f"W{w}.{kind}.b": f.b, f"W{w}.{kind}.sigma": f.sigma})
        meta = {"n_tokens": self.n_tokens, "planned_tokens": self.planned_tokens, "outlier_debt": self._outlier_debt,
                "rank_k": self.rank_k, "rank_v": self.rank_v}
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.comp_pos.truncate(0)
        self.factors = []
        self.reserve(int(meta["planned_tokens"]))
        if (self.rank_k, self.rank_v) != (int(meta["rank_k"]), int(meta["rank_v"])):
            raise ValueError(f"saved ranks {meta['rank_k']}/{meta['rank_v']} differ from this budget's "
                             f"{self.rank_k}/{self.rank_v}")
        self.comp_pos.load(tensors["comp_pos"].to(self.device))
        self.pend_pos.load(tensors["pend_pos"].to(self.device))
        for i, layer in enumerate(self.layers):
            for name in self._LAYER:
                getattr(layer, name).load(tensors[f"L{i}.{name}"].to(self.device))
            if layer.pend_k.length != self.pend_pos.length or layer.landmark.length * self.cfg.landmark_chunk \
                    != self.comp_pos.length:
                raise ValueError(f"layer {i}: row counts disagree with the saved positions")
        for w, pair in enumerate(self.factors):
            for kind, f in zip("kv", pair):
                b, sigma = tensors[f"W{w}.{kind}.b"], tensors[f"W{w}.{kind}.sigma"]
                if b.shape != f.b.shape or sigma.shape != f.sigma.shape:
                    raise ValueError(f"window {w}: factor shapes do not fit this model")
                f.restore((tensors[f"W{w}.{kind}.a"], b.to(f.b.dtype), sigma.float()))
                if f.a.length != self.comp_pos.length:
                    raise ValueError(f"window {w}: {f.a.length} factor rows for {self.comp_pos.length} tokens")
        self._outlier_debt = float(meta["outlier_debt"])
        self.n_tokens = int(meta["n_tokens"])

    # -- accounting --------------------------------------------------------------------------------
    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        L = self.layers[layer]
        tensors = [L.pend_k.data, L.pend_v.data, L.landmark.data, L.out_k.data, L.out_v.data, L.out_ids.data]
        window = self._window_of(layer)
        if self.factors and layer == self.windows[window][0]:  # a window's shared factors: at its first layer
            fk, fv = self.factors[window]
            tensors += fk.tensors() + fv.tensors()
        if layer == 0:
            tensors += [self.comp_pos.data, self.pend_pos.data]
        return tensors

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        if layer:
            return []
        snaps = {id(m["snapshot"]): m["snapshot"] for m in self._marks if m["snapshot"] is not None}
        return [t for snap in snaps.values() for pair in snap for part in pair for t in part]

    def observations(self) -> dict[str, Any]:
        if not self.factors:
            return {}
        return {"rank_k": self.rank_k, "rank_v": self.rank_v, "group": self.cfg.group,
                "compressed_tokens": self.comp_pos.length, "exact_tokens": self.pend_pos.length}


def _known(options: dict[str, Any]) -> dict[str, Any]:
    reject_unknown("xkv", options, set(XkvConfig.__dataclass_fields__))
    return options


@register_policy("xkv")
def _make(**kwargs: Any) -> XkvCache:
    return XkvCache(**kwargs)
