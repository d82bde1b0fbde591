"""SeKV's router: routing projections, per-layer/per-head zoom thresholds (trainable, < 0.1% of params).

Untrained default ("identity-like"): both projections select the d' head dimensions whose RoPE
frequency is lowest. Pre-RoPE keys/queries barely rotate in those dimensions, so the dot product of
pre-RoPE vectors there approximates the position-dependent attention logit without positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.config import ModelConfig
from .config import FILE_CHOICES, SekvConfig


def low_frequency_dims(config: ModelConfig, count: int) -> torch.Tensor:
    """Indices of the `count` head dims with the slowest RoPE rotation (unrotated dims first)."""
    D, rd = config.head_dim, config.rope_dim
    freq = torch.zeros(D, dtype=torch.float64)
    pair_freq = config.rope_base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if config.rope_interleaved:
        freq[:rd] = pair_freq.repeat_interleave(2)
    else:
        freq[:rd] = torch.cat([pair_freq, pair_freq])
    order = torch.sort(freq, stable=True).indices
    return torch.sort(order[:count]).values


#: Parameter names and their shapes in terms of (L, H, KV, D, d'); the router file and GGUF use them.
PARAMETER_SHAPES = {
    "q_proj": ("L", "D", "d'"),
    "k_proj": ("L", "D", "d'"),
    "threshold_logit": ("L", "H"),
    "rank_energy_logit": ("L", "KV"),
}


class Router(nn.Module):
    """Parameters: q_proj [L, D, d'], k_proj [L, D, d'] (per layer, shared by its heads: per-head
    projections would be 0.55% of SmolLM2-135M's weights, these keep the router under 0.1%),
    threshold_logit [L, H] and the rank gate rank_energy_logit [L, KV] (sigmoid = the SVD energy a
    span keeps, per layer and KV head)."""

    def __init__(self, config: ModelConfig, sekv: SekvConfig) -> None:
        super().__init__()
        L, H, KV, D = config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim
        dp = min(sekv.routing_dim, D)
        select = torch.zeros(D, dp)
        select[low_frequency_dims(config, dp), torch.arange(dp)] = 1.0
        self.routing_dim = dp
        self.q_proj = nn.Parameter(select.expand(L, D, dp).clone())
        self.k_proj = nn.Parameter(select.expand(L, D, dp).clone())
        logit = math.log(sekv.threshold / (1 - sekv.threshold))
        self.threshold_logit = nn.Parameter(torch.full((L, H), logit))
        energy = min(sekv.energy, 1 - 1e-6)
        self.rank_energy_logit = nn.Parameter(torch.full((L, KV), math.log(energy / (1 - energy))))
        self.trained = False
        # what SeKV's "auto" options run once trained: the router file may name other choices
        self.auto_choices = {option: choices[0] for option, (_, choices) in FILE_CHOICES.items()}

    def rank_energy(self, layer: int) -> torch.Tensor:
        """SVD energy kept per KV head [KV] by the rank gate of `layer`."""
        return torch.sigmoid(self.rank_energy_logit[layer].detach())

    def routing_keys(self, layer: int, summary_k: torch.Tensor) -> torch.Tensor:
        """summary_k [KV, S, D] (pre-RoPE) -> unit-norm routing keys [KV, S, d']."""
        keys = summary_k.float() @ self.k_proj[layer]
        return torch.nn.functional.normalize(keys, dim=-1)

    def relevance_logits(self, layer: int, q: torch.Tensor, routing_keys: torch.Tensor,
                         log_len: torch.Tensor) -> torch.Tensor:
        """q [H, T, D] pre-RoPE, routing_keys [KV, S, d'], log_len [S] -> logits [H, T, S] of
        sigmoid(q'.k'/sqrt(d') + log|S|)."""
        H = q.shape[0]
        KV = routing_keys.shape[0]
        qp = q.float() @ self.q_proj[layer]
        keys = routing_keys.float().repeat_interleave(H // KV, dim=0)
        return qp @ keys.transpose(1, 2) / math.sqrt(self.routing_dim) + log_len

    def thresholds(self, layer: int) -> torch.Tensor:
        """Per-head zoom thresholds as logits [H] (compare with relevance logits)."""
        return self.threshold_logit[layer]


def key_bounds(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Element-wise [min | max] of each span's keys: keys [KV, S, l, D], valid [S, l] -> [KV, S, 2D]."""
    inside = valid[None, :, :, None]
    lo = torch.where(inside, keys, float("inf")).amin(dim=2)
    hi = torch.where(inside, keys, float("-inf")).amax(dim=2)
    return torch.cat([lo, hi], dim=-1)


def bound_scores(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Quest-style upper bound of q.k over each span's tokens: q [H, T, D], bounds [H, S, 2D] -> [H, T, S].
    For every token k of span s, q.k <= sum_d max(q_d lo_d, q_d hi_d)."""
    lo, hi = bounds.float().split(q.shape[-1], dim=-1)
    return q.clamp_min(0) @ hi.transpose(1, 2) + q.clamp_max(0) @ lo.transpose(1, 2)
