"""Decode speed of the native SeKV step against stock llama.cpp at long contexts, with no prefill.

Reading a long document through the torch engine takes minutes at 32K and more at 128K, and a decode
step's cost does not depend on what the memory holds, only on its shape. So the SeKV side gets a
synthetic memory of the shape SeKV builds (sinks, anchors and the recent window exact; the rest in
full-length spans stored as rows in the host tier, one summary row each; a fixed zoom pool) filled with
random values, and the stock side prefills random ordinary tokens into llama.cpp's own full-f16-KV
context on the same loaded model (`sekv_stock_bench`). Both then decode the same number of tokens;
repeats alternate between the two so drifts of the machine hit both alike.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import SekvError
from .bindings import NativeMemory, NativeModel, StoreRows


@dataclass(frozen=True)
class MemoryShape:
    """The layout SeKV gives n_tokens of context: n_sink sinks, anchor_fraction of the compressed tokens
    as anchors and the `recent` newest tokens exact; spans of span_rows tokens; zoom_k spans zoomed per
    layer and KV head per step."""

    n_tokens: int
    zoom_k: int = 16
    span_rows: int = 64
    anchor_fraction: float = 0.05
    n_sink: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        if self.n_tokens < self.n_sink + self.recent + self.span_rows:
            raise SekvError(f"probe: {self.n_tokens} tokens leave no room for a single span")
        if self.zoom_k < 0 or self.span_rows < 1 or not 0 <= self.anchor_fraction < 1:
            raise SekvError("probe: need zoom_k >= 0, span_rows >= 1 and 0 <= anchor_fraction < 1")

    @property
    def n_spans(self) -> int:
        compressed = self.n_tokens - self.n_sink - self.recent
        return math.ceil(compressed * (1 - self.anchor_fraction) / self.span_rows)

    @property
    def n_exact(self) -> int:
        return self.n_tokens - self.n_spans * self.span_rows


def synthetic_memory(model: NativeModel, shape: MemoryShape, room: int, seed: int = 0,
                     scheduler: bool = False, learned_router: bool = False) -> NativeMemory:
    """A native memory of `shape` with random values (every span stored as rows), `room` free exact rows;
    learned_router: route with the model's router (random unit-norm routing keys)."""
    info = model.info
    L, KV, D = info.n_layer, info.n_head_kv, info.head_dim
    S, l, E = shape.n_spans, shape.span_rows, shape.n_exact
    rng = np.random.default_rng(seed)
    counts = np.zeros((L, 2), dtype=np.int32)
    memory = NativeMemory(model, E + room, S, l, 1, min(shape.zoom_k, S), 1.0, counts, counts + S,
                          scheduler=scheduler, learned_router=learned_router)
    starts = shape.n_sink + np.arange(S, dtype=np.int32) * l
    memory.set_spans(starts, np.full(S, l, dtype=np.int32))

    def block(*dims: int) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32).astype(np.float16)

    # one random block serves every layer: the step's cost does not depend on the values
    exact_k, exact_v, sum_k, sum_v = block(KV, E, D), block(KV, E, D), block(KV, S, D), block(KV, S, D)
    empty = np.zeros((0,), dtype=np.float16)
    is_raw = np.ones(S, dtype=np.int32)
    keys = StoreRows(is_raw, empty, empty, block(S, KV, l, D))
    values = StoreRows(is_raw, empty, empty, block(S, KV, D, l))
    route_k = None
    if learned_router:
        route_k = rng.standard_normal((KV, S, model.router_dim))
        route_k /= np.linalg.norm(route_k, axis=-1, keepdims=True)
    for layer in range(L):
        memory.set_exact(layer, exact_k, exact_v)
        memory.set_layer_spans(layer, sum_k, sum_v, keys, values)
        if route_k is not None:
            memory.set_layer_routing(layer, route_k)
    return memory


def time_decode(memory: NativeMemory, position: int, steps: int, seed: int = 0) -> float:
    """Tokens/s of `steps` native decode steps from `position` (ordinary random token ids)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1000, memory.model.info.n_vocab, size=steps)
    start = time.perf_counter()
    for i, token in enumerate(tokens):
        memory.decode(int(token), position + i)
    return steps / (time.perf_counter() - start)


@dataclass
class ProbeResult:
    context_tokens: int
    shape: dict
    stock_prefill_tok_s: list[float] = field(default_factory=list)
    stock_decode_tok_s: list[float] = field(default_factory=list)
    sekv_decode_tok_s: list[float] = field(default_factory=list)
    sekv_device_bytes: int = 0
    sekv_compute_bytes: int = 0
    sekv_host_bytes: int = 0
    full_kv_bytes: int = 0

    def summary(self) -> dict[str, float]:
        stock, sekv = statistics.median(self.stock_decode_tok_s), statistics.median(self.sekv_decode_tok_s)
        ratios = [s / b for s, b in zip(self.sekv_decode_tok_s, self.stock_decode_tok_s)]
        return {"stock_decode_tok_s": stock, "sekv_decode_tok_s": sekv, "ratio_of_medians": sekv / stock,
                "median_paired_ratio": statistics.median(ratios), "min_paired_ratio": min(ratios),
                "max_paired_ratio": max(ratios), "stock_prefill_tok_s": statistics.median(self.stock_prefill_tok_s)}


def probe(model: NativeModel, contexts: list[int], new_tokens: int, repeats: int, zoom_k: int,
          flash_attn: int = -1, progress: Callable[[str], None] = lambda _: None) -> list[ProbeResult]:
    """Stock vs SeKV decode tokens/s at each context length, repeats alternating between the two."""
    info = model.info
    results = []
    for n in contexts:
        shape = MemoryShape(n, zoom_k=zoom_k)
        memory = synthetic_memory(model, shape, room=new_tokens * repeats + 8)
        time_decode(memory, n, 2)  # warm-up: the first steps size the compute buffer
        result = ProbeResult(n, asdict(shape), full_kv_bytes=n * info.n_layer * 2 * info.n_head_kv * info.head_dim * 2)
        position = n + 2
        for r in range(repeats):
            prefill, decode = model.stock_bench(n, new_tokens, flash_attn)
            result.stock_prefill_tok_s.append(prefill)
            result.stock_decode_tok_s.append(decode)
            result.sekv_decode_tok_s.append(time_decode(memory, position, new_tokens, seed=r))
            position += new_tokens
            progress(f"{n} tokens, repeat {r + 1}/{repeats}: stock {decode:.1f} tok/s, "
                     f"SeKV {result.sekv_decode_tok_s[-1]:.1f} tok/s")
        used = memory.bytes()
        result.sekv_device_bytes, result.sekv_compute_bytes, result.sekv_host_bytes = used.device, used.compute, used.host
        memory.close()
        results.append(result)
    return results


def write(results: list[ProbeResult], out: Path, command: str, settings: dict) -> Path:
    """results.json (every repeat) and summary.md (medians and paired ratios); returns summary.md."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "settings": settings,
               "results": [{**asdict(r), "summary": r.summary()} for r in results]}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    lines = [f"# native decode probe\n\n```bash\n{command}\n```\n",
             "| context | stock decode tok/s | SeKV decode tok/s | SeKV / stock (paired: median, min-max) | "
             "SeKV device (memory + step) % of full KV | stock prefill tok/s |",
             "|---:|---:|---:|---|---:|---:|"]
    for r in results:
        s = r.summary()
        device = 100 * (r.sekv_device_bytes + r.sekv_compute_bytes) / r.full_kv_bytes
        lines.append(f"| {r.context_tokens} | {s['stock_decode_tok_s']:.1f} | {s['sekv_decode_tok_s']:.1f} | "
                     f"**{s['median_paired_ratio']:.2f}x** ({s['min_paired_ratio']:.2f}-{s['max_paired_ratio']:.2f}) | "
                     f"{device:.1f}% | {s['stock_prefill_tok_s']:.0f} |")
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
