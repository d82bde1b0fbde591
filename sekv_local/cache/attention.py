"""Exact grouped-query attention used by cache methods over whatever keys they hold."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def chunk_causal_mask(n_query: int, n_key: int, device: torch.device | None = None,
                      window: int | None = None) -> torch.Tensor | None:
    """Boolean mask [n_query, n_key] for a chunk whose queries are the last `n_query` of `n_key` keys
    (keys at consecutive positions). True = may attend.

    window: sliding-window attention (Gemma 3 local layers): a query sees only the `window` most recent
    keys, itself included (llama.cpp's LLAMA_SWA_TYPE_STANDARD: masked when q_pos - k_pos >= window).
    None when every query may see every key (a single decode token within the window).
    """
    if n_query == 1 and (window is None or n_key <= window):
        return None
    return _allowed_rows(0, n_query, n_query, n_key, device, window)


def _allowed_rows(start: int, stop: int, n_query: int, n_key: int, device: torch.device | None,
                  window: int | None) -> torch.Tensor:
    """Rows start:stop of chunk_causal_mask: bool [min(stop, n_query) - start, n_key]."""
    q_idx = torch.arange(start, min(stop, n_query), device=device)[:, None] + (n_key - n_query)
    k_idx = torch.arange(n_key, device=device)[None, :]
    allowed = k_idx <= q_idx
    if window is not None:
        allowed &= q_idx - k_idx < window
    return allowed


class CausalBias:
    """The additive causal mask of a chunk whose queries are the last T of S keys (with `window`, also
    masking keys more than window - 1 positions before the query: sliding-window layers), handed to
    gqa_attention as a :class:`ChunkBias` that makes the rows of one block of queries at a time: a whole
    [T, S] float mask of a 1,024-token chunk at 7K tokens was 28 MiB, beside a cache a fraction of that."""

    def __init__(self, device: torch.device | None = None, window: int | None = None) -> None:
        self.device = device
        self.window = window

    def __call__(self, n_query: int, n_key: int) -> "ChunkBias | None":
        if n_query == 1 and (self.window is None or n_key <= self.window):
            return None
        return ChunkBias(n_query, n_key, self.device, self.window)


class ChunkBias:
    """A chunk's causal bias [1, T, S], made a block of query rows at a time (`rows`) or whole (`whole`)."""

    def __init__(self, n_query: int, n_key: int, device: torch.device | None, window: int | None) -> None:
        self.n_query, self.n_key, self.device, self.window = n_query, n_key, device, window

    @property
    def shape(self) -> tuple[int, int, int]:
        return (1, self.n_query, self.n_key)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop [1, stop - start, S]: 0 where the query may attend, -inf elsewhere."""
        allowed = _allowed_rows(start, stop, self.n_query, self.n_key, self.device, self.window)
        return torch.zeros(allowed.shape, device=self.device).masked_fill_(~allowed, float("-inf"))[None]

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.n_query)


#: up to this many query tokens attention runs as grouped matmuls (decode steps, questions): CPU SDPA with a
#: float mask or GQA was 15-40x slower for one query token than the three ops below (measured, torch 2.13)
GROUPED_MAX_QUERIES = 32


#: the float32 logits of one block of query rows stay under this; a chunk's [H, T, S] logits at 7K tokens were
#: ~120 MiB, more than the device tier a method reports (the peak of a process is what a user pays)
ATTENTION_BLOCK_BYTES = 4 << 20


def query_block_rows(n_heads: int, n_query: int, n_key: int) -> int:
    """Query rows per block so that one block's [n_heads, rows, n_key] float32 logits fit ATTENTION_BLOCK_BYTES."""
    return max(1, min(n_query, ATTENTION_BLOCK_BYTES // max(4 * n_heads * n_key, 1)))


def _rows(x: "torch.Tensor | ChunkBias | None", n_query: int, start: int, stop: int) -> torch.Tensor | None:
    """Rows start:stop of a mask or bias whose second-to-last dimension is the query (or 1: shared)."""
    if isinstance(x, ChunkBias):
        return x.rows(start, stop)
    if x is None or x.shape[-2] != n_query:
        return x
    return x[..., start:stop, :]


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [H, T, D] over k/v [KV, S, D] with H a multiple of KV (GQA).

    mask: bool [T, S] or [H, T, S] (True = attend); bias: float [1 or KV or H, T or 1, S] added to the logits
    (e.g. SeKV's +log|S| on summary rows), or a ChunkBias (a chunk's causal mask, made block by block). Returns [H, T, D] in q's dtype. Long chunks run in blocks of
    query rows (:func:`query_block_rows`), so the transient logits stay bounded whatever the context.
    """
    n_heads, T = q.shape[0], q.shape[1]
    rows = query_block_rows(n_heads, T, k.shape[1])
    if rows >= T:
        return _attention_block(q, k, v, mask, _rows(bias, T, 0, T))
    k, v = k.to(q.dtype), v.to(q.dtype)
    return torch.cat([_attention_block(q[:, a: a + rows], k, v, _rows(mask, T, a, a + rows), _rows(bias, T, a, a + rows))
                      for a in range(0, T, rows)], dim=1)


def gqa_attention_parts(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        biases: list[torch.Tensor]) -> torch.Tensor:
    """gqa_attention over key blocks given as parts: keys/values [KV, S_i, D], biases [KV, T or 1, S_i]. The
    [KV, T, S] bias is built one block of query rows at a time, never whole. Returns [H, T, D]."""
    n_heads, T = q.shape[0], q.shape[1]
    key_all = torch.cat(keys, dim=1).to(q.dtype)
    value_all = torch.cat(values, dim=1).to(q.dtype)
    KV = key_all.shape[0]
    rows = query_block_rows(n_heads, T, key_all.shape[1])
    out = []
    for a in range(0, T, rows):
        n = min(rows, T - a)
        bias = torch.cat([_rows(b, T, a, a + n).expand(KV, n, -1) for b in biases], dim=2)
        out.append(_attention_block(q[:, a: a + n], key_all, value_all, None, bias))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """gqa_attention over one block of query rows (all of them when the logits fit)."""
    dtype = q.dtype
    k = k.to(dtype)
    v = v.to(dtype)
    if q.shape[1] <= GROUPED_MAX_QUERIES:
        return _grouped_attention(q, k, v, mask, bias)
    n_heads, n_kv = q.shape[0], k.shape[0]
    attn_mask = None
    if bias is not None:
        group = n_heads // n_kv
        if bias.shape[0] == n_kv and group > 1:
            bias = bias.repeat_interleave(group, dim=0)
        attn_mask = bias.to(dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        attn_mask = mask
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask[None]  # a 3-D mask with 4-D queries took CPU SDPA's slow path (2.5x)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=attn_mask,
                                          enable_gqa=n_heads != n_kv)[0]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """gqa_attention for a few query tokens: the G query heads of a KV head share one matmul with its keys
    (nothing is repeated per query head); logits and softmax in float32."""
    n_heads, T, D = q.shape
    n_kv, S = k.shape[0], k.shape[1]
    G = n_heads // n_kv
    logits = (q.float().reshape(n_kv, G * T, D) @ k.float().transpose(1, 2)).view(n_kv, G, T, S) / math.sqrt(D)
    if bias is not None:  # [KV or H or 1, T or 1, S]
        lead = (n_kv, G) if bias.shape[0] == n_heads else (n_kv, 1) if bias.shape[0] == n_kv else (1, 1)
        logits = logits + bias.float().view(*lead, bias.shape[1], S)
    if mask is not None:
        grouped = mask.view(n_kv, G, T, S) if mask.dim() == 3 else mask
        logits = logits.masked_fill(~grouped, float("-inf"))
    probs = torch.softmax(logits.view(n_kv, G * T, S), dim=-1)
    return (probs @ v.float()).view(n_heads, T, D).to(q.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [H, T, D] over k/v [KV, S, D] (GQA) that also returns the log-sum-exp of
    the logits [H, T], so results over disjoint key blocks can be merged (:func:`merge_attention`).
    bias: float [1 or KV or H, T or 1, S]. Rows whose keys are all masked give output 0 and lse -inf.
    Runs in blocks of query rows, as gqa_attention."""
    n_heads, T = q.shape[0], q.shape[1]
    group = n_heads // k.shape[0]
    kk = k.float().repeat_interleave(group, dim=0)
    vv = v.float().repeat_interleave(group, dim=0)
    rows = query_block_rows(n_heads, T, k.shape[1])
    outs, lses = [], []
    for a in range(0, T, rows):
        logits = q[:, a: a + rows].float() @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
        if bias is not None:
            b = _rows(bias, T, a, a + rows)
            logits = logits + (b.repeat_interleave(group, dim=0) if b.shape[0] == k.shape[0] and group > 1 else b)
        lse = torch.logsumexp(logits, dim=-1)  # [H, rows]
        weights = torch.exp(logits - lse.clamp_min(-1e30)[..., None]).nan_to_num_(0.0)
        outs.append(weights @ vv)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One softmax over the union of key blocks from per-block (output [H, T, D], lse [H, T]) pairs."""
    lses = torch.stack([lse for _, lse in parts])  # [B, H, T]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.clamp_min(-1e30)).nan_to_num_(0.0)  # [B, H, T]
    return sum(w[..., None] * out for w, (out, _) in zip(weights, parts))
