"""`sekv-local analyze layers`: how alike the KV caches of different layers are (xKV's observation).

Per layer the pre-RoPE keys (and values) of a text are a matrix X_l [T, kv_heads * head_dim]. Two
measures per layer pair:

* token cosine: mean over tokens of cos(X_i[t], X_j[t]) — are the same token's vectors aligned?
* linear CKA: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on centred X, Y — do the layers span the
  same token subspace, whatever basis each uses?

xKV's point: token cosine is low between layers, yet CKA is high, so one token basis serves a
window of layers (each with its own reconstruction block). Low CKA would say sharing cannot work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

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

    def adjacent(self) -> dict[str, float]:
        """Mean of each measure over neighbouring layer pairs (l, l+1)."""
        return {name: float(np.mean(np.diagonal(m, offset=1))) for name, m in self.matrices().items()}

    def matrices(self) -> dict[str, np.ndarray]:
        return {"key_cosine": self.key_cosine, "key_cka": self.key_cka,
                "value_cosine": self.value_cosine, "value_cka": self.value_cka}

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "adjacent_mean": self.adjacent(),
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
                           value_cosine=token_cosine(v_all).numpy(), value_cka=linear_cka(v_all).numpy())


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
