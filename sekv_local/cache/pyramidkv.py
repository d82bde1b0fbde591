"""`pyramidkv`: SnapKV with per-layer budgets that shrink linearly from the bottom layer to the top.

Scores, the observation window, chunked prefill and the question-agnostic/aware modes are SnapKV's
(see `snapkv`). Only the allocation differs: with C the tokens per layer that SnapKV gets from the
same budget and w the window, layer l keeps w + b_l tokens where b_l falls linearly from
max = 2(C - w) - min at the bottom to min = (C - w) / beta at the top (beta = 20 in the paper). The
b_l sum to n_layers * (C - w) exactly (rounded down, the remainder given to the bottom layers), so
the device tier matches SnapKV's byte for byte at the same budget: bottom layers get larger tensors,
top layers smaller ones. A prefill chunk larger than a top layer can take is processed by that layer
in parts (`part_tokens`).

Beyond the paper: the paper's budgets are far below the prompt length. At generous budgets the
bottom layers' 2(C - w) - min would exceed the tokens there are to keep, and those bytes would sit
unused while the top layers starve (at 95% of full KV the top layer kept ~5% of the document and
lost the needle). `cap_budgets` clips every layer at the planned length and hands the excess to the
layers under the cap in proportion to their pyramid share, so the shape is kept where it can be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import SekvError
from .base import register_policy
from .snapkv import SnapKVCache, SnapKVConfig, is_number


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    """beta: ratio of the bottom-to-average slope (min per-layer budget = (C - w) / beta); 20 in the paper."""

    method: ClassVar[str] = "pyramidkv"

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_number(self.beta) or not math.isfinite(self.beta) or self.beta < 1:
            raise SekvError(f"pyramidkv: beta must be a number >= 1, got {self.beta!r}")


def pyramid_budgets(total: int, n_layers: int, beta: float) -> list[int]:
    """Per-layer budgets b_0 >= ... >= b_{L-1} >= 1 falling linearly from 2*total - total/beta to
    total/beta, summing to n_layers * total (needs total >= beta)."""
    if n_layers == 1:
        return [total]
    low = total / beta
    high = 2 * total - low
    raw = [high - (high - low) * layer / (n_layers - 1) for layer in range(n_layers)]
    budgets = [max(1, math.floor(x)) for x in raw]
    remainder = n_layers * total - sum(budgets)
    for layer in range(max(remainder, 0)):  # remainder < n_layers: one more token for the lowest layers
        budgets[layer] += 1
    for _ in range(max(-remainder, 0)):  # (rounding of a minimum near 1) take back from the largest
        last_max = max(i for i, b in enumerate(budgets) if b == budgets[0])
        budgets[last_max] -= 1
    return budgets


def cap_budgets(budgets: list[int], cap: int) -> list[int]:
    """Clip per-layer budgets at `cap` and redistribute the excess to the layers below it, in
    proportion to their budgets (water-filling); the sum is kept unless every layer is at the cap."""
    out = [float(b) for b in budgets]
    total = float(sum(budgets))
    while True:
        capped = [i for i, b in enumerate(out) if b >= cap]
        excess = sum(out[i] - cap for i in capped)
        free = [i for i, b in enumerate(out) if b < cap]
        for i in capped:
            out[i] = float(cap)
        if excess <= 1e-9 or not free:
            break
        share = sum(out[i] for i in free)
        for i in free:
            out[i] += excess * out[i] / share
    result = [min(cap, math.floor(b)) for b in out]
    short = min(int(total), cap * len(result)) - sum(result)
    for i in sorted(range(len(result)), key=lambda i: -result[i]):  # rounding: fill the largest first
        if short <= 0:
            break
        if result[i] < cap:
            result[i] += 1
            short -= 1
    return result


class PyramidKVCache(SnapKVCache):
    name = "pyramidkv"
    config_class = PyramidKVConfig

    def min_tokens(self) -> int:
        return self.cfg.window + max(16, math.ceil(self.cfg.beta))

    def layer_capacities(self, capacity: int, planned_tokens: int) -> list[int]:
        w = self.cfg.window
        budgets = pyramid_budgets(capacity - w, self.config.n_layers, self.cfg.beta)
        return [w + b for b in cap_budgets(budgets, max(planned_tokens - w, 1))]


@register_policy("pyramidkv")
def _make(**kwargs: Any) -> PyramidKVCache:
    return PyramidKVCache(**kwargs)
