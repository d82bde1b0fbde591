"""Host-tier span store: truncated SVD factors of span keys (or values) for one layer.

Spans have different lengths and ranks, so factors live ragged in flat buffers: for span s with
length L, rank r and KV heads h: U (singular values folded in) as [KV, L, r] and W as [KV, r, D].
When r (L + D) >= L D the factors would be larger than the span, so the span is stored raw
([KV, L, D] in the W area, no U) — the store is never larger than the raw keys.
Packing and rebuilding are index arithmetic over all spans at once (no loops over spans or heads).
With `quant` ("q8_0" / "q4_0") both areas are kept in llama.cpp's blocks of 32 values (QuantFlatBuffer):
U blocks run along the flat area, W's along each row of D values; the singular values are then folded into W,
not U (see `_append`). A rebuild dequantizes what it gathers.
"""

from __future__ import annotations

import torch

from .buffers import FlatBuffer, QuantFlatBuffer, VecBuffer
from .config import AUTO_RANK_RULES


class FactorStore:
    def __init__(self, n_kv: int, head_dim: int, dtype: torch.dtype, pin: bool = False, quant: str | None = None) -> None:
        self.n_kv, self.head_dim = n_kv, head_dim
        self.quant = quant
        self.u: FlatBuffer | QuantFlatBuffer
        self.w: FlatBuffer | QuantFlatBuffer
        if quant is None:
            self.u, self.w = FlatBuffer(dtype, "cpu", pin), FlatBuffer(dtype, "cpu", pin)
        else:  # W rows start at multiples of D (whole rows are gathered), so D is the alignment
            self.u, self.w = QuantFlatBuffer(quant, pin=pin), QuantFlatBuffer(quant, align=head_dim, pin=pin)
        self.u_off = VecBuffer(torch.long, "cpu")
        self.w_off = VecBuffer(torch.long, "cpu")
        self.rank = VecBuffer(torch.long, "cpu")  # rows of W per head: the rank, or L when raw
        self.raw = VecBuffer(torch.bool, "cpu")

    @property
    def n_spans(self) -> int:
        return self.rank.length

    def add(self, x: torch.Tensor, lengths: torch.Tensor, energy: float | torch.Tensor, max_rank: int,
            rule: str = "span") -> torch.Tensor:
        """Factor new spans. x: [S, KV, l_max, D] float32 (rows past each length are zero);
        lengths: [S]; energy: kept fraction of squared singular values, one value or per KV head [KV].
        rule: "span" keeps `energy` of the span's total; "row" of every token row's own squared norm (a
        few distinctive rows, such as a needle's digits, carry little of the total); "exact" keeps every
        span raw, lossless (energy and max_rank unused, no SVD).
        Returns the stored rank per span [S] (L for raw spans)."""
        if rule not in AUTO_RANK_RULES:  # a misspelt rule must not silently run another
            raise ValueError(f"unknown rank rule {rule!r}")
        S, KV, l_max, D = x.shape
        if S == 0:
            return torch.zeros(0, dtype=torch.long)
        x = x.float().cpu()
        lengths = lengths.cpu()
        if rule == "exact":
            return self._append(x, lengths, lengths.clone(), torch.ones(S, dtype=torch.bool), None)
        U, sv, Vh = torch.linalg.svd(x, full_matrices=False)  # [S,KV,l_max,m], [S,KV,m], [S,KV,m,D]
        rank = self._ranks(U, sv, lengths, energy, max_rank, rule == "row")
        raw = rank * (lengths + D) >= lengths * D
        return self._append(x, lengths, rank, raw, (U, sv, Vh))

    @staticmethod
    def _ranks(U: torch.Tensor, sv: torch.Tensor, lengths: torch.Tensor, energy: float | torch.Tensor,
               max_rank: int, per_row: bool) -> torch.Tensor:
        """Rank per span [S], shared by its KV heads: the smallest keeping `energy`, capped by max_rank and
        the span's length."""
        l_max = U.shape[2]
        # per span: energy of each singular component [S, KV, m]; per row: of each row's component [S, KV, l_max, m]
        power = (U * sv[..., None, :]).square() if per_row else sv.square()
        cum = power.cumsum(-1) / power.sum(-1, keepdim=True).clamp_min(1e-30)
        keep = energy
        if torch.is_tensor(energy):
            keep = energy.to("cpu", cum.dtype).reshape(-1)[None, :, None]
            keep = keep[..., None] if per_row else keep
        need = (cum < keep).sum(-1) + 1
        if per_row:  # padding rows of short spans are numerical noise: they need no rank
            real = (torch.arange(l_max)[None, :] < lengths[:, None])[:, None, :]  # [S, 1, l_max]
            need = torch.where(real, need, 0).amax(dim=2)
        rank = need.amax(dim=1)
        return torch.minimum(torch.minimum(rank, torch.full_like(rank, max_rank)), lengths)

    def _append(self, x: torch.Tensor, lengths: torch.Tensor, rank: torch.Tensor, raw: torch.Tensor,
                svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Pack spans into the flat buffers: x [S, KV, l_max, D]; rank, raw [S]; svd (U, sv, Vh) of x, None
        when every span is raw."""
        S, KV, l_max, D = x.shape
        eff = torch.where(raw, lengths, rank)
        M = int(eff.max())
        j = torch.arange(M)
        # W area: rows of Vh (factored) or of x itself (raw), [S, KV, M, D]
        w_src = torch.zeros(S, KV, M, D)
        w_src[:, :, : min(M, l_max)] = x[:, :, :M]
        u_flat = x.new_zeros(0)
        if svd is not None:
            U, sv, Vh = svd
            # quantized: the singular values go into W, so U's orthonormal columns hold values of one magnitude and
            # a block of 32 that runs across rows of U loses no row to another's scale (folded into U, a row of
            # small tokens was read back with ~4% error at q8_0); unquantized: into U
            into_w = self.quant is not None
            t = torch.arange(l_max)
            # U area: [S, KV, l_max, R]; empty for raw spans
            R = min(M, U.shape[-1])
            u_vals = U[..., :R] if into_w else U[..., :R] * sv[..., None, :R]
            if into_w:
                Vh = Vh * sv[..., :, None]
            u_mask = ((t[None, :, None] < lengths[:, None, None]) & (j[None, None, :R] < rank[:, None, None])
                      & ~raw[:, None, None])  # [S, l_max, R]
            u_flat = u_vals[u_mask[:, None].expand(S, KV, l_max, R)]
            factored = torch.zeros(S, KV, M, D)
            factored[:, :, : min(M, Vh.shape[2])] = Vh[:, :, :M]
            w_src = torch.where(raw[:, None, None, None], w_src, factored)
        w_mask = (j[None, :] < eff[:, None])[:, None, :, None].expand(S, KV, M, D)
        w_flat = w_src[w_mask]

        u_count = torch.where(raw, torch.zeros_like(rank), KV * lengths * rank)
        w_count = KV * eff * D
        u_base = self.u.append(u_flat)
        w_base = self.w.append(w_flat)
        self.u_off.append(u_base + torch.cumsum(u_count, 0) - u_count)
        self.w_off.append(w_base + torch.cumsum(w_count, 0) - w_count)
        self.rank.append(eff)
        self.raw.append(raw)
        return eff

    def rebuild(self, heads: torch.Tensor, spans: torch.Tensor, lengths: torch.Tensor, l_max: int,
                columns: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """Rows of (head, span) pairs: heads, spans [n] -> [n, l_max, D] float32 (zero past each length).
        lengths: [all spans] span lengths. columns [n] + width: rebuild only features
        columns[i] .. columns[i] + width of each pair (a store shared by several layers and heads)."""
        n = int(spans.numel())
        D = self.head_dim
        out_width = D if columns is None else int(width)
        if n == 0:
            return torch.zeros(0, l_max, out_width)
        heads, spans = heads.cpu(), spans.cpu()
        r = self.rank.view()[spans]
        raw = self.raw.view()[spans]
        # feature offsets of each pair [n, 1, width]; None: whole rows
        d = None if columns is None else columns.cpu()[:, None, None] + torch.arange(out_width)[None, None, :]
        out = torch.zeros(n, l_max, out_width)
        # raw spans and factored ones are gathered apart: a raw span's W is its rows (as many as its length), a
        # factored span's only r rows, and one gather padded to the longest raw span read ~10x the bytes
        raw_ids = raw.nonzero().flatten()
        if raw_ids.numel():  # raw spans: W holds the rows themselves (zero past each length); no product needed
            rows = min(int(r[raw_ids].max()), l_max)
            out[raw_ids, :rows] = self._gather_w(spans, heads, r, d, raw_ids, rows)
        fac = (~raw).nonzero().flatten()
        if fac.numel():
            f_spans, f_heads, f_r, f_L = spans[fac], heads[fac], r[fac], lengths.cpu()[spans[fac]]
            M = int(f_r.max())
            jf, t = torch.arange(M), torch.arange(l_max)
            u_idx = self.u_off.view()[f_spans][:, None, None] \
                + (f_heads[:, None, None] * f_L[:, None, None] + t[None, :, None]) * f_r[:, None, None] + jf[None, None, :]
            u_ok = (t[None, :, None] < f_L[:, None, None]) & (jf[None, None, :] < f_r[:, None, None])
            U = torch.where(u_ok, self.u.take(u_idx.clamp(max=max(self.u.length - 1, 0))).float(), 0.0)
            out[fac] = U @ self._gather_w(spans, heads, r, d, fac, M)
        return out

    def _gather_w(self, spans: torch.Tensor, heads: torch.Tensor, r: torch.Tensor, d: torch.Tensor | None,
                  pick: torch.Tensor, M: int) -> torch.Tensor:
        """W rows j < M of the picked (head, span) pairs -> [len(pick), M, width] float32, zero for j >= rank.
        d: feature offsets [n, 1, width] of every pair, or None for whole rows (width D)."""
        D = self.head_dim
        j = torch.arange(M)
        rp = r[pick]
        first = self.w_off.view()[spans[pick]][:, None] + (heads[pick][:, None] * rp[:, None] + j[None, :]) * D  # [p, M]
        w_ok = (j[None, :] < rp[:, None])[:, :, None]
        if d is None:  # every W row starts at a multiple of D: gather rows, not single values (D x fewer indices)
            n_rows = self.w.length // D
            if n_rows == 0:
                return torch.zeros(len(pick), M, D)
            return torch.where(w_ok, self.w.rows((first // D).clamp(max=n_rows - 1), D).float(), 0.0)
        w_idx = first[:, :, None] + d[pick]
        return torch.where(w_ok, self.w.take(w_idx.clamp(max=max(self.w.length - 1, 0))).float(), 0.0)

    def stored_bytes(self, heads: torch.Tensor, spans: torch.Tensor, lengths: torch.Tensor,
                     width: int | None = None) -> int:
        """Host bytes a rebuild of these (head, span) pairs [n] reads: a raw span's rows, or a factored span's U
        [L, r] and W [r, width] (width: the features read, head_dim unless a shared store is read in part)."""
        if spans.numel() == 0:
            return 0
        spans = spans.cpu()
        r = self.rank.view()[spans]
        L = lengths.cpu()[spans]
        w = self.head_dim if width is None else int(width)
        values = torch.where(self.raw.view()[spans], r * w, L * r + r * w)
        return round(int(values.sum()) * self.w.value_bytes)

    def all_bytes(self) -> int:
        """Host bytes of every stored span (what one pass over the whole store reads)."""
        return round((self.u.length + self.w.length) * self.w.value_bytes)

    def truncate(self, n_spans: int) -> None:
        """Forget spans from index n_spans on."""
        if n_spans >= self.n_spans:
            return
        self.u.truncate(int(self.u_off.view()[n_spans]))
        self.w.truncate(int(self.w_off.view()[n_spans]))
        for buf in (self.u_off, self.w_off, self.rank, self.raw):
            buf.truncate(n_spans)

    _TABLES = ("u_off", "w_off", "rank", "raw")

    def export_state(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.{name}{suffix}": t for name in ("u", "w") for suffix, t in getattr(self, name).state().items()}
        out.update({f"{prefix}.{name}": getattr(self, name).view() for name in self._TABLES})
        return out

    def import_state(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        for name in ("u", "w"):
            head = f"{prefix}.{name}"
            getattr(self, name).load_state({key[len(head):]: t for key, t in tensors.items()
                                            if key == head or key.startswith(head + ".")})
        for name in self._TABLES:
            getattr(self, name).load(tensors[f"{prefix}.{name}"])
        n = self.n_spans
        if not (self.u_off.length == self.w_off.length == self.raw.length == n):
            raise ValueError("inconsistent span factor tables")
        if n and (int(self.u_off.view().max()) > self.u.length or int(self.w_off.view().max()) > self.w.length):
            raise ValueError("span factor offsets point outside the stored factors")

    def tensors(self) -> list[torch.Tensor]:
        return [*self.u.tensors(), *self.w.tensors(), self.u_off.data, self.w_off.data, self.rank.data, self.raw.data]
