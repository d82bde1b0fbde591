"""The differentiable SeKV student the router is trained through.

The context's memory is built the way `SekvCache` builds it (same segmentation, surprisal-weighted
summaries at span centres, pre-RoPE span SVD, sinks + anchors + recent window exact), from the
teacher's keys and values. The query tokens then run through the frozen model against it with the
hard choices made soft so that gradients reach the router:

* zoom: gate g = sigmoid(relevance - threshold) per head, query and span; a span's rebuilt rows get
  the bias log g and its summary row log(1 - g) + log|S| (g = 1: fully zoomed, g = 0: summary only);
* rank: singular value i of a span is kept with weight sigmoid((tau - E_i) / RANK_TEMPERATURE),
  E_i = energy fraction before i, tau = the rank gate of the layer and KV head.

The student is causal: query token t sees the context and query tokens <= t only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..cache.attention import chunk_causal_mask, gqa_attention
from ..models.rope import Rope
from ..sekv.config import SekvConfig
from ..sekv.router import Router
from ..sekv.segmentation import segment
from .teacher import OnePassPolicy, TeacherRecord

RANK_TEMPERATURE = 0.02
_EPS = 1e-6


@dataclass
class LayerTerms:
    """What one layer contributes to the losses: gate logits and teacher targets [H, M, S], the
    expected kept-rank fraction and the normalized reconstruction error (both scalars)."""

    gate_logits: torch.Tensor
    target: torch.Tensor
    rank_fraction: torch.Tensor
    reconstruction: torch.Tensor


@dataclass
class SpanLayout:
    """Context segmentation shared by all layers: exact positions [E], span token index [S, P] and
    mask [S, P] (P = longest span), span lengths [S], centres [S], surprisal weights [S, P]."""

    exact: torch.Tensor
    index: torch.Tensor
    inside: torch.Tensor
    lengths: torch.Tensor
    centers: torch.Tensor
    weights: torch.Tensor


def layout_spans(surprisal: torch.Tensor, cfg: SekvConfig) -> SpanLayout:
    """Segment the context like SekvCache: sinks and the last `recent` tokens exact, the rest cut at
    surprisal > mean + alpha * std into spans (anchors at most anchor_fraction of them)."""
    n = int(surprisal.shape[0])
    start, end = min(cfg.n_sink, n), max(min(cfg.n_sink, n), n - cfg.recent)
    region = surprisal[start:end]
    if region.numel() == 0:
        raise ValueError("context too short for the recent window and sinks: no spans to train on")
    threshold = float(region.mean() + cfg.alpha * region.std(unbiased=False))
    seg = segment(region, threshold, cfg.l_min, cfg.l_max, int(cfg.anchor_fraction * region.numel()), flush=True)
    exact = torch.cat([torch.arange(start), seg.anchors + start, torch.arange(start + seg.consumed, n)])
    pad = int(seg.span_len.max())
    t = torch.arange(pad)
    index = (seg.span_start[:, None] + start + t[None, :]).clamp(max=n - 1)
    inside = t[None, :] < seg.span_len[:, None]
    weights = torch.where(inside, surprisal[index].clamp_min(0) + 1e-3, 0.0)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return SpanLayout(torch.sort(exact).values, index, inside, seg.span_len,
                      seg.span_start + start + seg.span_len // 2, weights)


class SoftSekvCache(OnePassPolicy):
    """Attention of the query tokens over the soft SeKV memory of the teacher's context (see module doc)."""

    name = "sekv-student"
    #: local layers of a Gemma 3 model attend exactly within their window (never compressed, as in
    #: MixedLayers); the router has one layer per global layer
    supports_sliding_window = True

    def __init__(self, record: TeacherRecord, rope: Rope, router: Router, cfg: SekvConfig,
                 layout: SpanLayout, config: Any) -> None:
        super().__init__(config, rope)
        self.record, self.router, self.cfg, self.layout = record, router, cfg, layout
        self.terms: list[LayerTerms] = []
        self._log_len = layout.lengths.float().log()
        self._router_layer = {layer: j for j, layer in enumerate(config.global_layers)}
        self._svd = {layer: self._factor(layer) for layer in config.global_layers}

    @torch.no_grad()
    def _factor(self, layer: int) -> tuple[Any, ...]:
        """Per layer: the spans' padded K (pre-RoPE) and V [KV, S, P, D] with their SVDs and energies."""
        n = self.record.n_context
        lay = self.layout
        k_pre, v = self.record.k[layer][:, :n].float(), self.record.v[layer][:, :n].float()
        out = []
        for x in (k_pre, v):
            padded = torch.where(lay.inside[None, :, :, None], x[:, lay.index], 0.0)  # [KV, S, P, D]
            U, s, Vh = torch.linalg.svd(padded, full_matrices=False)
            power = s.square()
            before = (power.cumsum(-1) - power) / power.sum(-1, keepdim=True).clamp_min(1e-30)  # [KV, S, m]
            out.append((padded, U, s, Vh, before))
        return tuple(out)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.config.is_local(layer):
            return self._attend_window(layer, q, k, v)
        rec, lay, router = self.record, self.layout, self.router
        j = self._router_layer[layer]
        H, M, D = q.shape
        KV = k.shape[0]
        G = H // KV
        n = rec.n_context
        pos_q = self._positions
        q_rot = self.rope.apply(q, pos_q, self._cos_sin)
        k_ctx_pre = rec.k[layer][:, :n].float()
        v_ctx = rec.v[layer][:, :n].float()

        # exact rows: sinks, anchors, recent window
        k_exact = self.rope.apply(k_ctx_pre[:, lay.exact], lay.exact)
        v_exact = v_ctx[:, lay.exact]
        # rebuilt rows through the soft rank gate (same gate for K and V, as in SekvCache)
        tau = torch.sigmoid(router.rank_energy_logit[j])[:, None, None]  # [KV, 1, 1]
        rebuilt, recon, kept = [], [], []
        for padded, U, s, Vh, before in self._svd[layer]:
            real = torch.arange(s.shape[-1])[None, :] < lay.lengths[:, None]  # [S, m]: past a span's length s = 0
            keep = torch.sigmoid((tau - before) / RANK_TEMPERATURE) * real  # [KV, S, m]
            x_hat = (U * (s * keep)[..., None, :]) @ Vh  # [KV, S, P, D]
            err = (padded - x_hat).square().sum(dim=(-2, -1)) / padded.square().sum(dim=(-2, -1)).clamp_min(1e-12)
            rebuilt.append(x_hat)
            recon.append(err.mean())
            kept.append((keep.sum(-1) / lay.lengths.float()).mean())
        S, P = lay.index.shape
        k_span = self.rope.apply(rebuilt[0].reshape(KV, S * P, D), lay.index.reshape(-1))
        v_span = rebuilt[1].reshape(KV, S * P, D)
        # summaries and the router's gate
        w = lay.weights
        sum_k_pre = torch.einsum("ksld,sl->ksd", self._svd[layer][0][0], w)
        sum_k = self.rope.apply(sum_k_pre, lay.centers)
        sum_v = torch.einsum("ksld,sl->ksd", self._svd[layer][1][0], w)
        route_k = router.routing_keys(j, sum_k_pre)
        gate_logits = router.relevance_logits(j, q, route_k, self._log_len) \
            - router.thresholds(j)[:, None, None]  # [H, M, S]
        log_g, log_not_g = F.logsigmoid(gate_logits), F.logsigmoid(-gate_logits)

        def scores(keys: torch.Tensor) -> torch.Tensor:  # [KV, N, D] -> [H, M, N]
            return q_rot @ keys.repeat_interleave(G, dim=0).transpose(1, 2) / math.sqrt(D)

        pad_bias = torch.where(lay.inside.reshape(-1), 0.0, float("-inf"))
        span_logits = scores(k_span) + log_g.repeat_interleave(P, dim=-1) + pad_bias
        sum_logits = scores(sum_k) + log_not_g + self._log_len
        self_logits = scores(self.rope.apply(k, pos_q, self._cos_sin)) \
            + torch.full((M, M), float("-inf")).triu(1)
        logits = torch.cat([scores(k_exact), span_logits, sum_logits, self_logits], dim=-1)
        values = torch.cat([v_exact, v_span, sum_v, v], dim=1).repeat_interleave(G, dim=0)
        out = torch.softmax(logits, dim=-1) @ values

        self.terms.append(LayerTerms(gate_logits, self._target(layer), torch.stack(kept).mean(),
                                     torch.stack(recon).mean()))
        return out

    def _attend_window(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exact sliding-window attention of a local layer: the query tokens over the last window - 1
        context tokens and themselves, with the local RoPE. [H, M, D]"""
        n, window = self.record.n_context, self.config.sliding_window
        first = max(0, n - window + 1)
        keys = torch.cat([self.record.k[layer][:, first:n].float(), k], dim=1)
        values = torch.cat([self.record.v[layer][:, first:n].float(), v], dim=1)
        rope, cos_sin = self.layer_rope(layer)
        key_pos = torch.arange(first, n + q.shape[1])
        return gqa_attention(rope.apply(q, self._positions, cos_sin), rope.apply(keys, key_pos), values,
                             mask=chunk_causal_mask(q.shape[1], keys.shape[1], window=window))

    @torch.no_grad()
    def _target(self, layer: int, cover: float = 0.8, floor: float = 0.01) -> torch.Tensor:
        """1 for the spans that carry the teacher's attention: the fewest spans holding `cover` of the
        span mass of a (head, query), each with at least `floor` of the whole attention. [H, M, S]"""
        rec, lay = self.record, self.layout
        q_rot = self.rope.apply(rec.q[layer].float(), self._positions)
        k_all = rec.k[layer].float()
        T = k_all.shape[1]
        H, M, D = q_rot.shape
        k_rot = self.rope.apply(k_all, torch.arange(T)).repeat_interleave(H // k_all.shape[0], dim=0)
        causal = torch.arange(T)[None, :] <= self._positions[:, None]
        probs = torch.softmax(torch.where(causal, q_rot @ k_rot.transpose(1, 2) / math.sqrt(D), float("-inf")), -1)
        mass = (probs[:, :, lay.index] * lay.inside).sum(-1)  # [H, M, S]
        order = mass.sort(dim=-1, descending=True)
        before = order.values.cumsum(-1) - order.values
        chosen = (before < cover * mass.sum(-1, keepdim=True)) & (order.values >= floor)
        return torch.zeros_like(mass).scatter_(-1, order.indices, chosen.float())


@dataclass
class LossWeights:
    kl: float = 1.0
    zoom_bce: float = 0.5
    reconstruction: float = 0.5
    budget: float = 1.0
    zoom_target: float = 0.25
    rank_target: float = 0.5


@dataclass
class StepLosses:
    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)


def student_losses(model: Any, rope: Rope, router: Router, cfg: SekvConfig, record: TeacherRecord,
                   weights: LossWeights) -> StepLosses:
    """Run the query tokens through the student and combine the four losses (docs/DESIGN.md §5.6)."""
    layout = layout_spans(record.surprisal, cfg)
    cache = SoftSekvCache(record, rope, router, cfg, layout, model.config)
    n, M = record.n_context, record.query_ids.numel()
    cache.begin_chunk(torch.arange(n, n + M), is_prefill=False)
    logits = model(record.query_ids, cache, logits="all").float()
    kl = F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(record.logits, -1), log_target=True,
                  reduction="batchmean")
    gate_logits = torch.stack([t.gate_logits for t in cache.terms])
    target = torch.stack([t.target for t in cache.terms])
    bce = F.binary_cross_entropy_with_logits(gate_logits, target)
    recon = torch.stack([t.reconstruction for t in cache.terms]).mean()
    zoom = torch.sigmoid(gate_logits).mean()
    rank = torch.stack([t.rank_fraction for t in cache.terms]).mean()
    budget = F.relu(zoom - weights.zoom_target).square() + F.relu(rank - weights.rank_target).square()
    total = weights.kl * kl + weights.zoom_bce * bce + weights.reconstruction * recon + weights.budget * budget
    parts = {name: float(value.detach()) for name, value in (
        ("kl", kl), ("zoom_bce", bce), ("reconstruction", recon), ("budget", budget), ("zoom_fraction", zoom),
        ("rank_fraction", rank), ("target_fraction", target.mean()))}
    parts["spans"] = int(layout.lengths.numel())
    return StepLosses(total, parts)
