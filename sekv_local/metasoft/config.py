"""Meta-Soft's cache settings in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import check_cache_dtype
from ..errors import config_check

POOLS = ("avg", "max")


@dataclass(frozen=True)
class MetaSoftConfig:
    """Settings of the `metasoft` cache method.

    n_sink: attention-sink tokens at the start, never dropped.
    recent: most recent tokens never dropped (the document tail, the question, generated tokens).
    pool_kernel / pool: 1-D pooling of the probe scores over neighbouring kept positions (SnapKV's
        selection rule applied to the soft tokens' scores).
    merge: route every dropped token into its most similar kept token (False: plain eviction, an ablation).
    balance: weight of the load-balancing penalty, balance * log(1 + tokens already absorbed), when a
        dropped token picks its kept token (0: nearest key only).
    count_bias: add log(count) to the attention logit of a kept token that represents `count` tokens
        (the attention the merged tokens would have drawn flows to it); False: values merged only.
    static: use the library's static combination instead of the prompt-dependent selector (ablation).
    trained: use trained soft tokens (baked into the GGUF, given by `params`, or packaged) when there are
        some; False runs the untrained library (embeddings of fixed question words).
    params: a Meta-Soft parameter file (safetensors from `sekv-local train --method metasoft`).
    chunk_fraction: share of the per-layer budget one prefill chunk may take.
    dtype: storage type of the kept K/V.
    """

    n_sink: int = 4
    recent: int = 32
    pool_kernel: int = 5
    pool: str = "avg"
    merge: bool = True
    balance: float = 0.1
    count_bias: bool = False
    static: bool = False
    trained: bool = True
    params: str | None = None
    chunk_fraction: float = 0.25
    dtype: str = "f16"

    def __post_init__(self) -> None:
        need = config_check("metasoft")
        need(_is_int(self.n_sink) and self.n_sink >= 0, f"n_sink must be an integer >= 0, got {self.n_sink!r}")
        need(_is_int(self.recent) and self.recent >= 1, f"recent must be an integer >= 1, got {self.recent!r}")
        need(_is_int(self.pool_kernel) and self.pool_kernel >= 1 and self.pool_kernel % 2 == 1,
             f"pool_kernel must be an odd integer >= 1, got {self.pool_kernel!r}")
        need(self.pool in POOLS, f"pool must be one of {POOLS}, got {self.pool!r}")
        for name in ("merge", "count_bias", "static", "trained"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        need(_is_number(self.balance) and self.balance >= 0, f"balance must be a number >= 0, got {self.balance!r}")
        need(self.params is None or isinstance(self.params, str), "params must be a file path")
        need(_is_number(self.chunk_fraction) and 0 < self.chunk_fraction < 1,
             f"chunk_fraction must be in (0, 1), got {self.chunk_fraction!r}")
        check_cache_dtype("metasoft", self.dtype)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
