"""Entropy-guided segmentation: surprisal -> spans and anchors, vectorized over tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.transformer import ChunkScores


def token_surprisal(logits: torch.Tensor | ChunkScores, token_ids: torch.Tensor) -> torch.Tensor:
    """Surprisal -log p(x_t | x_<t) of a chunk's tokens -> [T] float32 on the CPU, zero where nothing
    predicted the token.

    logits: the chunk's ChunkScores (row log-normalisers and gathered logits: the prefill computes no
    [T, V] tensor for them; the engine fills in the first token's from the previous chunk's last row), or
    logits [T, V] / [1, V] (row t predicts token t + 1); token_ids [T].
    """
    scores = logits if isinstance(logits, ChunkScores) else ChunkScores.from_logits(logits, token_ids)
    T = int(token_ids.shape[0])
    surprisal = torch.zeros(T)
    if scores.first_nll is not None:
        surprisal[0] = scores.first_nll
    if T > 1 and scores.nll.shape[0] == T - 1:
        surprisal[1:] = scores.nll.cpu()
    return surprisal


@dataclass
class RunningStats:
    """Mean and variance of every surprisal seen so far (Chan et al. batch update)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> None:
        n = int(values.numel())
        if n == 0:
            return
        values = values.double()
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 0.0

    def copy(self) -> "RunningStats":
        return RunningStats(self.count, self.mean, self.m2)


@dataclass
class Segmentation:
    """Result over a region of n tokens (indices relative to the region start).

    span_start, span_len: [S] spans to compress; anchors: [A] tokens kept exact;
    consumed: tokens [0, consumed) are covered (spans + anchors); the rest stays pending.
    """

    span_start: torch.Tensor
    span_len: torch.Tensor
    anchors: torch.Tensor
    consumed: int


def segment(surprisal: torch.Tensor, threshold: float, l_min: int, l_max: int, anchor_quota: int,
            forced_anchors: int = 0, flush: bool = False) -> Segmentation:
    """Cut a region of tokens into spans at high-surprisal tokens.

    surprisal: [n] for the region's tokens. A token whose surprisal exceeds `threshold` is a cut
    candidate; a candidate closer than `l_min` to the previous candidate is dropped (so every span is
    at least `l_min` long); spans longer than `l_max` are split evenly. The `anchor_quota`
    highest-surprisal cut tokens stay exact (anchors) and leave their span. The first `forced_anchors`
    tokens (attention sinks) are always anchors. The tail after the last cut stays pending unless
    `flush` (only whole `l_max` pieces of it are consumed).
    """
    n = int(surprisal.shape[0])
    device = surprisal.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    forced = torch.arange(min(forced_anchors, n), device=device)
    base = int(forced.numel())
    if n - base <= 0:
        return Segmentation(empty, empty, forced, n)
    body = surprisal[base:]
    m = n - base

    candidates = torch.nonzero(body > threshold).flatten()
    candidates = candidates[candidates > 0]
    cuts = torch.cat([torch.zeros(1, dtype=torch.long, device=device), candidates])
    keep = torch.ones_like(cuts, dtype=torch.bool)
    keep[1:] = (cuts[1:] - cuts[:-1]) >= l_min
    cuts = cuts[keep]
    is_candidate = torch.ones_like(cuts, dtype=torch.bool)
    is_candidate[0] = False

    # Spans between cuts; the last one runs to the end of the region (the tail).
    ends = torch.cat([cuts[1:], torch.tensor([m], device=device)])
    lengths = ends - cuts
    if flush:
        tail_keep = lengths[-1]
    else:
        tail_keep = (lengths[-1] // l_max) * l_max  # whole l_max pieces of the tail
    lengths = torch.cat([lengths[:-1], tail_keep.view(1)])
    valid = lengths > 0
    cuts, lengths, is_candidate = cuts[valid], lengths[valid], is_candidate[valid]
    consumed_body = int((cuts[-1] + lengths[-1]).item()) if cuts.numel() else 0
    if not flush and consumed_body < m and cuts.numel() and int(lengths[-1]) < l_min:
        # a short last span (possible only when flushing) would violate l_min
        cuts, lengths, is_candidate = cuts[:-1], lengths[:-1], is_candidate[:-1]
        consumed_body = int((cuts[-1] + lengths[-1]).item()) if cuts.numel() else 0

    # Anchors: the highest-surprisal cut candidates within the quota.
    anchor_mask = torch.zeros_like(is_candidate)
    if anchor_quota > 0 and bool(is_candidate.any()):
        cand_pos = torch.nonzero(is_candidate).flatten()
        k = min(anchor_quota, int(cand_pos.numel()))
        top = torch.topk(body[cuts[cand_pos]], k).indices
        anchor_mask[cand_pos[top]] = True
    anchors = cuts[anchor_mask]
    starts = cuts + anchor_mask.long()
    lengths = lengths - anchor_mask.long()

    # Split spans longer than l_max into near-equal pieces (each >= l_max / 2 >= l_min).
    pieces = torch.clamp((lengths + l_max - 1) // l_max, min=1)
    span_idx = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), pieces)
    piece_no = torch.arange(span_idx.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(pieces, 0) - pieces, pieces)
    total, count = lengths[span_idx], pieces[span_idx]
    piece_start = starts[span_idx] + (total * piece_no) // count
    piece_end = starts[span_idx] + (total * (piece_no + 1)) // count
    piece_len = piece_end - piece_start
    nonempty = piece_len > 0
    return Segmentation(piece_start[nonempty] + base, piece_len[nonempty],
                        torch.cat([forced, anchors + base]), base + consumed_body)
