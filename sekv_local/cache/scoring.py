"""Shared pieces of the score-based eviction methods (`h2o`, `snapkv`, `pyramidkv`, `chunkkv`).

* `attention_scores`: exact attention of a block of queries over the kept keys, computed in blocks of
  queries so no [T, S] matrix larger than `block_elems` exists at once; it returns the attention
  output and, per key and KV head, the attention probability the key received (summed over the
  queries and the query heads of its GQA group).
* `pool_positions`: SnapKV's 1-D pooling of scores over neighbouring (kept) positions.
* `ScoredKV`: one layer's kept tokens in tensors sized to the budget. Slots `[0, length)` are valid
  and stay in position order (eviction compacts, new tokens are appended at the end), so the tokens
  of a chunk always sit after every older kept token.
* `drop_lowest`: which slots an eviction removes, from a per-slot rank key.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

#: queries x keys x heads of one block of attention probabilities (16 Mi floats = 64 MiB in f32)
BLOCK_ELEMS = 1 << 24
#: rank-key offsets: tokens that no window has scored yet rank above every scored token (newest
#: first), protected tokens (a recent window) above those; both stay ordered by position
UNSCORED_RANK = float(2 ** 40)
PROTECTED_RANK = float(2 ** 50)


def attention_scores(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor,
                     values: torch.Tensor | None = None,
                     block_elems: int = BLOCK_ELEMS) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Softmax attention of q [H, T, D] over keys [KV, S, D] (post-RoPE), causal by position.

    q_pos [T] and key_pos [P, S] (P = 1 or KV: per-head positions) are absolute positions; query t
    sees key s of head h when key_pos[h, s] <= q_pos[t]. Returns (output [H, T, D] in q's dtype or
    None when `values` is None, received [KV, S] float32 = attention probability summed over the T
    queries and the H/KV query heads of each KV head).
    """
    n_heads, n_query, dim = q.shape
    n_kv, n_key = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    qf = q.float().reshape(n_kv, group, n_query, dim)
    kt = keys.float().transpose(1, 2)[:, None]  # [KV, 1, D, S]
    vf = values.float()[:, None] if values is not None else None  # [KV, 1, S, D]
    kp = key_pos[:, None, None, :]  # [P, 1, 1, S]
    out = torch.empty(n_kv, group, n_query, dim, device=q.device) if values is not None else None
    received = torch.zeros(n_kv, n_key, device=q.device)
    rows = max(1, block_elems // max(1, n_heads * n_key))
    scale = dim ** -0.5
    for a in range(0, n_query, rows):
        b = min(n_query, a + rows)
        logits = torch.matmul(qf[:, :, a:b], kt) * scale  # [KV, G, r, S]
        visible = kp <= q_pos[a:b].to(kp.dtype)[None, None, :, None]
        probs = torch.softmax(logits.masked_fill_(~visible, float("-inf")), dim=-1)
        if out is None:  # a window query whose every visible key was evicted scores nothing
            probs = probs.nan_to_num_(0.0)
        received += probs.sum(dim=(1, 2))
        if out is not None:
            out[:, :, a:b] = torch.matmul(probs, vf)
    if out is None:
        return None, received
    return out.reshape(n_heads, n_query, dim).to(q.dtype), received


def attend_in_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, step: int,
                    attend_part: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """A chunk q [H, T, D], k/v [KV, T, D] at positions [T] handed to attend_part in consecutive parts of
    at most `step` tokens (each part makes room in a budgeted store before it is written); outputs
    concatenated [H, T, D]."""
    outs = [attend_part(q[:, a: a + step], k[:, a: a + step], v[:, a: a + step], positions[a: a + step])
            for a in range(0, positions.shape[0], step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def pool_positions(scores: torch.Tensor, kernel: int, mode: str = "avg") -> torch.Tensor:
    """Pool scores [P, S] over neighbouring slots (= neighbouring kept positions); odd kernel, same length."""
    if kernel <= 1 or scores.shape[1] == 0:
        return scores
    x = scores[:, None]
    if mode == "avg":
        return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)[:, 0]
    return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)[:, 0]


def drop_lowest(rank: torch.Tensor, n_drop: int) -> torch.Tensor:
    """Boolean mask [P, S], True on the `n_drop` lowest-ranked slots of every row."""
    mask = torch.zeros(rank.shape, dtype=torch.bool, device=rank.device)
    if n_drop > 0:
        mask.scatter_(1, rank.topk(n_drop, dim=1, largest=False).indices, True)
    return mask


class ScoredKV:
    """One layer's kept tokens: post-RoPE keys/values [KV, capacity, D], positions [P, capacity]
    (int32, -1 = empty) and scores [P, capacity] (float32). P = KV when every KV head keeps its own
    tokens, P = 1 when all heads of the layer keep the same ones. All four are allocated once, at
    the size the budget gives this layer."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, rows: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.capacity = capacity
        self.k = torch.zeros(n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((rows, capacity), -1, dtype=torch.int32, device=device)
        self.score = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        self.length = 0

    @staticmethod
    def bytes_per_token(n_kv: int, head_dim: int, rows: int, dtype: torch.dtype) -> int:
        return n_kv * 2 * head_dim * dtype.itemsize + rows * (4 + 4)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos, self.score]

    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]

    def positions(self) -> torch.Tensor:
        return self.pos[:, : self.length]

    def scores(self) -> torch.Tensor:
        return self.score[:, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, score: float) -> None:
        """Write a chunk k/v [KV, T, D] at positions [T] after the kept tokens (the caller made room)."""
        n, t = self.length, k.shape[1]
        if n + t > self.capacity:
            raise RuntimeError(f"ScoredKV: {n} + {t} tokens exceed the capacity {self.capacity}")
        self.k[:, n: n + t] = k.to(self.k.dtype)
        self.v[:, n: n + t] = v.to(self.v.dtype)
        self.pos[:, n: n + t] = positions.to(torch.int32)
        self.score[:, n: n + t] = score
        self.length = n + t

    def keep(self, mask: torch.Tensor) -> None:
        """Keep the slots where mask [P, length] is True (the same count in every row), compacted
        to the front in their order."""
        rows, n = mask.shape
        m = int(mask[0].sum())
        idx = mask.nonzero()[:, 1].view(rows, m)
        kv_idx = idx.expand(self.k.shape[0], m) if rows == 1 else idx
        gather = kv_idx[..., None].expand(-1, -1, self.k.shape[2])
        self.k[:, :m] = torch.gather(self.k[:, :n], 1, gather)
        self.v[:, :m] = torch.gather(self.v[:, :n], 1, gather)
        self.pos[:, :m] = torch.gather(self.pos[:, :n], 1, idx)
        self.score[:, :m] = torch.gather(self.score[:, :n], 1, idx)
        self.pos[:, m:] = -1
        self.score[:, m:] = 0.0
        self.length = m

    def snapshot(self) -> dict[str, Any]:
        """The valid part, copied to host memory."""
        n = self.length
        return {"length": n, "k": self.k[:, :n].cpu().clone(), "v": self.v[:, :n].cpu().clone(),
                "pos": self.pos[:, :n].cpu().clone(), "score": self.score[:, :n].cpu().clone()}

    def restore(self, snap: dict[str, Any]) -> None:
        n = snap["length"]
        self.k[:, :n].copy_(snap["k"])
        self.v[:, :n].copy_(snap["v"])
        self.pos[:, :n].copy_(snap["pos"])
        self.score[:, :n].copy_(snap["score"])
        self.pos[:, n:] = -1
        self.score[:, n:] = 0.0
        self.length = n
