"""`sekv-local analyze layers`: how alike the KV caches of different layers are (xKV's observation).

Per layer the pre-RoPE keys (and values) of a text are a matrix X_l [T, kv_heads * head_dim]. Two
measures per layer pair:

* token cosine: mean over tokens of cos(X_i[t], X_j[t]) — are the same token's vectors aligned?
* linear CKA: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on centred X, Y — do the layers span the
  same token subspace, whatever basis each uses?

xKV's point: token cosine is low between layers, yet CKA is high, so one token basis serves a
window of layers (each with its own reconstruction block). Low CKA would say sharing cannot work.

CKA says whether sharing can work; :func:`sharing_error` says whether it pays: the error of the best
rank-r factorization of each window of G layers when every G gets the same factor bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache.xkv import factor_rank
from ..documents import Document
from ..session import Session, SessionSettings


@dataclass
class LayerSimilarity:
    """[n_layers, n_layers] matrices for keys and values."""

    tokens: int
    key_cosine: np.ndarray
    key_cka: np.ndarray
    value_cosine: np.ndarray
    value_cka: np.ndarray
    sharing: dict[str, dict[int, dict[float, float]]]  # "keys"/"values" -> G -> bytes fraction -> error

    def adjacent(self) -> dict[str, float]:
        """Mean of each measure over neighbouring layer pairs (l, l+1)."""
        return {name: float(np.mean(np.diagonal(m, offset=1))) for name, m in self.matrices().items()}

    def matrices(self) -> dict[str, np.ndarray]:
        return {"key_cosine": self.key_cosine, "key_cka": self.key_cka,
                "value_cosine": self.value_cosine, "value_cka": self.value_cka}

    def as_dict(self) -> dict[str, Any]:
        sharing = {kind: {str(g): {str(f): round(e, 4) for f, e in by_f.items()} for g, by_f in by_g.items()}
                   for kind, by_g in self.sharing.items()}
        return {"tokens": self.tokens, "adjacent_mean": self.adjacent(), "sharing_error": sharing,
                **{name: np.round(m, 4).tolist() for name, m in self.matrices().items()}}


def token_cosine(x: torch.Tensor) -> torch.Tensor:
    """x [L, T, F] -> [L, L]: mean over tokens of the cosine between layers' vectors of the same token."""
    unit = torch.nn.functional.normalize(x.double(), dim=-1)
    return torch.einsum("itf,jtf->ij", unit, unit) / x.shape[1]


def linear_cka(x: torch.Tensor) -> torch.Tensor:
    """x [L, T, F] -> [L, L] linear CKA between layers (1 on the diagonal, invariant to rotations)."""
    centred = x.double() - x.double().mean(dim=1, keepdim=True)
    gram = torch.einsum("itf,itg->ifg", centred, centred)  # X_l^T X_l [L, F, F]
    cross = torch.einsum("itf,jtg->ijfg", centred, centred)  # X_i^T X_j [L, L, F, F]
    hsic = cross.square().sum(dim=(-1, -2))
    norms = gram.square().sum(dim=(-1, -2)).sqrt()
    return hsic / (norms[:, None] * norms[None, :]).clamp_min(1e-30)


#: window sizes and factor-byte fractions :func:`sharing_error` compares by default
SHARING_GROUPS = (1, 2, 4)
SHARING_FRACTIONS = (0.5, 0.25, 0.125)


def equal_bytes_rank(fraction: float, layers: int, tokens: int, features: int, group: int) -> int:
    """Rank per window whose factors (counted as `xkv` stores them) take `fraction` of the layers'
    uncompressed layers * T * F numbers."""
    rank = factor_rank(int(fraction * layers * tokens * features), tokens, layers, group, features)
    return max(0, min(rank, tokens, group * features))


def sharing_error(x: torch.Tensor, groups: tuple[int, ...] = SHARING_GROUPS,
                  fractions: tuple[float, ...] = SHARING_FRACTIONS) -> dict[int, dict[float, float]]:
    """x [L, T, F] (one layer's cache per row) -> {G: {fraction: relative error}}.

    Each window of G adjacent layers, [T, G*F] with features side by side, is cut to its best rank-r
    approximation (truncated SVD) with r from :func:`equal_bytes_rank`; the error is
    ||X - X_r||_F / ||X||_F over all layers together. A G >= 2 below G = 1 means a shared token basis
    stores the cache more cheaply than one basis per layer.
    """
    x = x.double()
    L, T, F = x.shape
    total = x.square().sum()
    result: dict[int, dict[float, float]] = {}
    for group in groups:
        # squared singular values of every window, largest first; a shorter last window is its own batch
        tails_of: list[torch.Tensor] = []
        full = L // group * group
        for layers, size in ((x[:full], group), (x[full:], L - full)):
            if size:
                windows = layers.reshape(-1, size, T, F)
                wide = windows.permute(0, 2, 1, 3).reshape(windows.shape[0], T, size * F)  # [W, T, g*F]
                tails_of.append(torch.linalg.svdvals(wide).square())
        result[group] = {}
        for fraction in fractions:
            rank = equal_bytes_rank(fraction, L, T, F, group)
            tail = sum(float(s[:, rank:].sum()) for s in tails_of)
            result[group][fraction] = (tail / float(total)) ** 0.5
    return result


def measure(text: str, model: str, max_tokens: int, threads: int | None = None) -> LayerSimilarity:
    """Feed `text` (cut to max_tokens) through the full-KV torch engine and compare its layers' caches."""
    session = Session.create(Document.from_text(text),
                             SessionSettings(model=model, method="full", threads=threads), show_progress=False)
    prefix, doc = session.prompt.document_tokens(text)
    ids = (prefix + doc)[:max_tokens]
    engine = session.engine
    engine.reset()
    engine.feed(ids)
    cache = engine.cache
    positions = torch.arange(len(ids))
    unrotate = cache.rope.cos_sin(-positions)
    keys, values = [], []
    for store in cache.layers:
        k = cache.rope.apply(store.keys().float(), -positions, unrotate)  # back to pre-RoPE
        keys.append(k.transpose(0, 1).reshape(len(ids), -1))
        values.append(store.values().float().transpose(0, 1).reshape(len(ids), -1))
    k_all, v_all = torch.stack(keys), torch.stack(values)
    return LayerSimilarity(tokens=len(ids), key_cosine=token_cosine(k_all).numpy(), key_cka=linear_cka(k_all).numpy(),
                           value_cosine=token_cosine(v_all).numpy(), value_cka=linear_cka(v_all).numpy(),
                           sharing={"keys": sharing_error(k_all), "values": sharing_error(v_all)})


def plot(result: LayerSimilarity, path: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 9), layout="constrained", dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for ax, (name, matrix) in zip(axes.ravel(), result.matrices().items()):
        image = ax.imshow(matrix, vmin=min(0.0, float(matrix.min())), vmax=1.0, cmap="viridis")
        ax.set_title(f"{name.replace('_', ' ')} (adjacent mean {np.mean(np.diagonal(matrix, 1)):.2f})")
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def write(result: LayerSimilarity, out: Path, title: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = out / "layer_similarity.json"
    data.write_text(json.dumps(result.as_dict(), indent=1))
    return {"json": data, "plot": plot(result, out / "layer_similarity.png", title)}
