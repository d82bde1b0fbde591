"""Question-time selection for SeKV (`select=question`): the pieces that do not need the cache's state.

When a question arrives its tokens attend exactly over every span's rows, which the host tier keeps in
full; the attention mass each span gets ranks the spans, and the best ones are pinned on the device for
the answer (their coarse summary rows leave the softmax), so a decode step reads back only a few routed
spans beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.attention import query_block_rows


@dataclass
class PinnedRows:
    """One layer's pinned spans for the current answer, on the device.

    k, v: [KV, R, D] at the cache dtype, keys post-RoPE at their own positions; pos: [R] positions;
    mask: [S0] bool, the pinned spans among the S0 spans that existed when the question was read.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor

    def mask_for(self, n_spans: int) -> torch.Tensor:
        """The pinned-span mask over n_spans spans [n_spans] (spans made since the question are not pinned)."""
        extra = n_spans - self.mask.shape[0]
        return self.mask if extra <= 0 else torch.cat([self.mask, self.mask.new_zeros(extra)])

    def extended(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n_spans: int,
                 new_spans: int) -> "PinnedRows":
        """These pins plus `new_spans` spans appended after the first n_spans (all pinned): their rows k, v
        [KV, n, D] post-RoPE, positions [n]."""
        mask = torch.cat([self.mask_for(n_spans), self.mask.new_ones(new_spans)])
        return PinnedRows(torch.cat([self.k, k.to(self.k.dtype)], 1), torch.cat([self.v, v.to(self.v.dtype)], 1),
                          torch.cat([self.pos, pos]), mask)


#: how a span's share of the question's attention [H, T] becomes one score: the most any head gives it from any
#: question token ("max"), from the last token ("last"), on average over the question's tokens ("mean"), or the
#: most any head gives it from any token relative to what that head gives it from the question's typical token
#: ("lift": position alone draws a head to the spans next to the sinks and the recent window from every token,
#: a question's words draw it to the spans that match them)
PIN_SCORES = ("max", "last", "mean", "lift")

#: "lift" divides by the median share plus this over the number of spans: a span every token ignores stays low
LIFT_FLOOR = 0.01


def question_span_score(mass: torch.Tensor, rule: str) -> torch.Tensor:
    """mass [H, T, S]: each span's share of each head's attention from each question token -> score [S]."""
    if rule == "lift":
        typical = mass.median(dim=1, keepdim=True).values + LIFT_FLOOR / mass.shape[-1]
        return (mass / typical).amax(dim=(0, 1))
    if rule == "max":
        return mass.amax(dim=(0, 1))
    if rule == "last":
        return mass[:, -1].amax(dim=0)
    if rule == "mean":
        return mass.mean(dim=1).amax(dim=0)
    raise ValueError(f"unknown pin score {rule!r}")


def spread_to_neighbours(score: torch.Tensor, weight: float) -> torch.Tensor:
    """score [S] (spans in document order) -> [S]: each span scores at least `weight` times either neighbour's
    score. A fact cut by a span boundary then ranks its second half right after its first."""
    if weight <= 0 or score.numel() < 2:
        return score
    zero = score.new_zeros(1)
    neighbours = torch.maximum(torch.cat([zero, score[:-1]]), torch.cat([score[1:], zero]))
    return torch.maximum(score, weight * neighbours)


def voted_spans(scores: torch.Tensor, lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """scores [L, S] (each layer's ranking of the spans), lengths [S] -> [S]: how many layers would pin each span
    on their own (its best-scored spans within `rows`), ties broken by the summed reciprocal rank. A span that a
    few layers' content heads single out outvotes the positional favourites that differ from layer to layer."""
    order = torch.argsort(scores, dim=1, descending=True)  # [L, S]
    fits = (torch.cumsum(lengths[order], dim=1) <= rows).long().cumprod(dim=1).bool()
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    picked = torch.zeros_like(fits).scatter_(1, order, fits)
    reciprocal = (1.0 / (1.0 + rank.float())).sum(dim=0)
    return picked.sum(dim=0).float() + reciprocal / (reciprocal.max() + 1.0)


def pick_spans(score: torch.Tensor, lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """The best-scored spans whose rows fit in `rows`: score, lengths [S] -> span ids [n] in score order.
    Spans are taken in score order while their total length fits (a span that would overflow ends it)."""
    if rows <= 0 or score.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=score.device)
    order = torch.argsort(score, descending=True)
    fits = torch.cumsum(lengths[order], 0) <= rows
    return order[: int(fits.long().cumprod(0).sum())]


def block_attention_with_span_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                                  n_spans: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of q [H, T, D] over one block of n_spans spans' rows, k/v [KV, n_spans * pad, D] (GQA; every
    span padded to `pad` rows), bias [KV, n_spans * pad] (-inf on padding). Returns the block's output
    [H, T, D], its log-sum-exp [H, T] (to merge with other blocks) and each span's log-sum-exp [H, T, n_spans]
    (exp(span - total) is the span's share of the question's attention)."""
    H, T, D = q.shape
    KV, N = k.shape[0], k.shape[1]
    G = H // KV
    kf, vf, bf = k.float().transpose(1, 2), v.float(), bias.float()[:, None, None, :]
    rows = query_block_rows(H, T, N)  # the transient logits stay bounded for a long question
    outs, lses, spans = [], [], []
    for a in range(0, T, rows):
        n = min(rows, T - a)
        logits = (q[:, a: a + n].float().reshape(KV, G * n, D) @ kf).view(KV, G, n, N) / math.sqrt(D) + bf
        per_span = torch.logsumexp(logits.view(KV, G, n, n_spans, N // n_spans), dim=-1)  # [KV, G, n, S]
        lse = torch.logsumexp(per_span, dim=-1)  # [KV, G, n]
        weights = torch.exp(logits - lse[..., None]).nan_to_num_(0.0)
        outs.append((weights.view(KV, G * n, N) @ vf).view(H, n, D))
        lses.append(lse.reshape(H, n))
        spans.append(per_span.reshape(H, n, n_spans))
    if len(outs) == 1:
        return outs[0], lses[0], spans[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1), torch.cat(spans, dim=1)
