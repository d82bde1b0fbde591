"""The torch engine's SeKV memory in the native layout (sekv_native.h), as numpy arrays.

Spans are ragged in the torch FactorStore (per span: rank r, or stored raw when factors would not be
smaller); the native graph needs fixed shapes, so a layer's factored spans become U [l, R] and W^T [D, R]
zero-padded to the longest span l and the largest stored rank R, and its raw spans their rows [l, D] (keys rotated at their own positions: no RoPE at decode time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..cache.base import CachePolicy
from ..cache.mixed_layers import MixedLayers
from ..errors import SekvError
from ..quant_blocks import QK
from .bindings import NativeHostRows, NativeMemory, NativeModel, StoreRows
from ..sekv.buffers import FlatBuffer, QuantFlatBuffer
from ..sekv.factors import FactorStore
from ..sekv.policy import SekvCache


@dataclass
class LayerExport:
    exact_k: np.ndarray  # [KV, n, D] post-RoPE
    exact_v: np.ndarray
    sum_k: np.ndarray  # [KV, S, D] post-RoPE at the span centre
    sum_v: np.ndarray
    keys: StoreRows | None  # None: the spans' rows are in the native host rows, not exported
    values: StoreRows | None
    route_k: np.ndarray | None  # [KV, S, d'] unit-norm routing keys of the learned router (None: training-free rule)
    pins: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # pinned rows k, v [KV, n, D] (k post-RoPE), mask [S]
    read_bytes: np.ndarray  # int64 [S]: host bytes one KV head's zoom into each span reads (K and V, padded slots)


@dataclass
class MemoryExport:
    span_start: np.ndarray  # int32 [S]
    span_len: np.ndarray  # int32 [S]
    span_rows: int  # l
    rank: int  # R
    layers: list[LayerExport]
    router: tuple[np.ndarray, np.ndarray] | None  # learned router: q_proj [L, D, d'], threshold_logit [L, H]

    @property
    def n_exact(self) -> int:
        return int(self.layers[0].exact_k.shape[1])

    def pin_rows(self) -> np.ndarray | None:
        """Pinned rows per layer int32 [n_layer] (None: no layer has pins)."""
        if all(layer.pins is None for layer in self.layers):
            return None
        return np.array([0 if l.pins is None else l.pins[0].shape[1] for l in self.layers], dtype=np.int32)

    def store_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Factored and raw spans per layer, keys then values: two int32 [n_layer, 2] (every span raw where the
        rows were not exported: they are the host rows')."""
        S = len(self.span_len)
        raw = np.array([[S, S] if l.keys is None else [int(l.keys.is_raw.sum()), int(l.values.is_raw.sum())]
                        for l in self.layers], dtype=np.int32).reshape(len(self.layers), 2)
        return S - raw, raw


def sekv_of(cache: CachePolicy) -> tuple[SekvCache, list[int]]:
    """The SeKV memory behind `cache` and the model layer each of its layers is (on a model with sliding-window
    layers SeKV holds the global ones; the windows stay beside it)."""
    if isinstance(cache, MixedLayers):
        return cache.inner, list(cache.global_layers)
    return cache, list(range(cache.config.n_layers))


def supported(cache: CachePolicy) -> str | None:
    """Why the native engine cannot run this memory (None: it can)."""
    if isinstance(cache, MixedLayers):
        cache = cache.inner
    if not isinstance(cache, SekvCache):
        return f"method '{cache.name}'"
    if cache.cfg.share_layers != 1:
        return "span factors shared across layers (sekv+xkv)"
    if cache.router_kind not in ("attention", "projection", "union"):
        return f"the '{cache.router_kind}' router (the native graph routes with the 'attention' rule, the learned " \
               f"one or their union)"
    if cache.cfg.positions != "original" or cache._shift:
        return "the 'bounded' position strategy"
    if cache.cfg.dtype != "f16":
        return f"dtype {cache.cfg.dtype} (the native memory is f16)"
    return None


def _gather(buffer: FlatBuffer | QuantFlatBuffer, index: torch.Tensor) -> torch.Tensor:
    """The buffer's values at index where valid; any value where masked later (an empty store has nothing to
    read)."""
    if buffer.length == 0:
        return torch.zeros(index.shape, dtype=torch.float16)
    return buffer.take(index.clamp(0, buffer.length - 1))


def decompressed_rows(store: FactorStore, lengths: torch.Tensor, starts: torch.Tensor, rows: int, values: bool,
                      rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      first: int = 0) -> StoreRows:
    """Spans first.. as raw rows [S - first, KV, l, D] rebuilt from their factors once (keys rotated; values
    transposed)."""
    S, KV = store.n_spans - first, store.n_kv
    heads = torch.arange(KV).repeat(S)
    spans = torch.arange(first, first + S).repeat_interleave(KV)
    x = store.rebuild(heads, spans, lengths, rows).view(S, KV, rows, store.head_dim)  # S may be 0
    if rotate is not None and S:
        x = rotate(x, starts[first: first + S, None] + torch.arange(rows)[None, :])
    if values:
        x = x.transpose(-1, -2)
    empty = np.zeros((0,), dtype=np.float16)
    return StoreRows(np.ones(S, dtype=np.int32), empty, empty, x.to(torch.float16).contiguous().numpy())


def store_rows(store: FactorStore, lengths: torch.Tensor, starts: torch.Tensor, rows: int, rank: int, values: bool,
               rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> StoreRows:
    """A store's spans in the native layout (float16, zero padded; values' raw rows transposed).
    rotate(x [n, KV, l, D], positions [n, l]): RoPE for raw keys, which the native graph reads as they
    are (factored keys are rotated there, after U W)."""
    S, KV, D = store.n_spans, store.n_kv, store.head_dim
    r = store.rank.view()[:S]
    raw = store.raw.view()[:S]
    L = lengths[:S].cpu()
    h = torch.arange(KV)[None, :, None, None]
    t = torch.arange(rows)
    fac = (~raw).nonzero().flatten()
    R = rank
    j = torch.arange(R)
    # factored: W rows j < r at w[w_off + (h r + j) D + d]; U rows t < L, cols j < r at u[u_off + (h L + t) r + j]
    rf, Lf = r[fac][:, None, None, None], L[fac][:, None, None, None]
    w_idx = store.w_off.view()[fac][:, None, None, None] + (h * rf + j[None, None, :, None]) * D \
        + torch.arange(D)[None, None, None, :]
    w = torch.where(j[None, None, :, None] < rf, _gather(store.w, w_idx), 0)  # [F, KV, R, D]
    u_idx = store.u_off.view()[fac][:, None, None, None] + (h * Lf + t[None, None, :, None]) * rf \
        + j[None, None, None, :]
    u_ok = (t[None, None, :, None] < Lf) & (j[None, None, None, :] < rf)
    u = torch.where(u_ok, _gather(store.u, u_idx), 0)  # [F, KV, l, R]
    # raw: the span's rows [KV, L, D] at w_off
    raw_ids = raw.nonzero().flatten()
    Lr = L[raw_ids][:, None, None, None]
    x_idx = store.w_off.view()[raw_ids][:, None, None, None] + (h * Lr + t[None, None, :, None]) * D \
        + torch.arange(D)[None, None, None, :]
    x = torch.where(t[None, None, :, None] < Lr, _gather(store.w, x_idx), 0)  # [n_raw, KV, l, D]
    if rotate is not None:
        x = rotate(x.float(), starts[raw_ids][:, None] + t[None, :])
    if values:
        x = x.transpose(-1, -2)
    half = torch.float16
    return StoreRows(raw.to(torch.int32).numpy(), u.to(half).numpy(), w.transpose(-1, -2).to(half).contiguous().numpy(),
                     x.to(half).contiguous().numpy())


def read_bytes(stores: tuple[StoreRows, StoreRows] | int, rows: int, rank: int, head_dim: int,
               value_bytes: float = 2.0) -> np.ndarray:
    """Host bytes [S] the native step reads when one KV head zooms into each span: the span's slot in its
    keys' and its values' table (raw rows l x D, or factors U l x R and W D x R), padded as stored, at
    value_bytes per value (2 for f16; a quantized block's share of its scale included). stores: the two stores,
    or the number of spans when every span is raw (the native host rows)."""
    raw_slot, factor_slot = round(rows * head_dim * value_bytes), round((rows + head_dim) * rank * value_bytes)
    if isinstance(stores, int):
        return np.full(stores, 2 * raw_slot, dtype=np.int64)
    return sum(np.where(store.is_raw != 0, raw_slot, factor_slot).astype(np.int64) for store in stores)


def native_rank(rank: int, rows: int, host_quant: str) -> int:
    """The factor columns R of the native tables: the largest stored rank, raised where a quantized table's rows
    (R x l values) must be whole blocks of 32 (the extra columns are zero)."""
    if host_quant == "none":
        return rank
    step = QK // math.gcd(rows, QK)
    return -(-rank // step) * step


def rotator(cache: SekvCache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """RoPE for span rows x [n, KV, l, D] at positions [n, l], as the native host tier stores raw keys."""

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the host tier lives on the CPU; RoPE's tables live where the model runs
        x, positions = x.to(cache.device), positions.to(cache.device)
        cos, sin = cache.rope.cos_sin(positions.reshape(-1))
        shape = (positions.shape[0], 1, positions.shape[1], cos.shape[-1])
        return cache.rope.apply(x, positions, (cos.view(shape), sin.view(shape))).cpu()

    return rotate


def export_memory(cache: SekvCache, decompress: bool = False, host_rows: int | None = None) -> MemoryExport:
    """decompress: hand the native memory every span as rows, rebuilt once here, instead of factors it
    rebuilds at every step (the host tier then holds about the full KV; the device tier is unchanged).
    host_rows: the span_rows of native host rows that already hold every span (their rows are not exported)."""
    why = supported(cache)
    if why is not None:
        raise SekvError(f"the native engine does not support {why} yet; use --engine torch")
    S = cache.span_len.length
    lengths = cache.span_len.view().cpu()
    rows = host_rows if host_rows is not None else int(lengths.max()) if S else 1
    stores = [store for layer in cache.layers for store in (layer.fac_k, layer.fac_v)]
    factored = [store.rank.view()[~store.raw.view()] for store in stores]
    rank = 1 if host_rows is not None else \
        native_rank(max([1] + [int(f.max()) for f in factored if f.numel()]), rows, cache.cfg.host_quant)
    starts = cache.span_pos.view().cpu()
    rotate = rotator(cache)
    learned = cache.router_kind in ("projection", "union")
    out = []
    for layer_no, layer in enumerate(cache.layers):
        exact_k = torch.cat([layer.exact_k.view(), layer.pend_k.view()], dim=1)
        exact_v = torch.cat([layer.exact_v.view(), layer.pend_v.view()], dim=1)
        if host_rows is not None:
            keys = values = None
        elif decompress:
            keys = decompressed_rows(layer.fac_k, lengths, starts, rows, values=False, rotate=rotate)
            values = decompressed_rows(layer.fac_v, lengths, starts, rows, values=True)
        else:
            keys = store_rows(layer.fac_k, lengths, starts, rows, rank, values=False, rotate=rotate)
            values = store_rows(layer.fac_v, lengths, starts, rows, rank, values=True)
        route_k = layer.route_k.view().cpu().half().numpy() if learned else None
        pinned = cache.pins(layer_no)
        pins = None if pinned is None else (pinned.k.cpu().half().numpy(), pinned.v.cpu().half().numpy(),
                                            pinned.mask_for(S).cpu().numpy())
        out.append(LayerExport(exact_k.cpu().half().numpy(), exact_v.cpu().half().numpy(),
                               layer.sum_k.view().cpu().half().numpy(), layer.sum_v.view().cpu().half().numpy(),
                               keys, values, route_k, pins,
                               read_bytes(S if keys is None else (keys, values), rows, rank, cache.config.head_dim,
                                          cache.host_value_bytes)))
    router = None
    if learned:
        router = (cache.router.q_proj.detach().float().cpu().numpy(),
                  cache.zoom_thresholds().float().cpu().numpy())
    return MemoryExport(cache.span_pos.view().cpu().numpy().astype(np.int32), lengths.numpy().astype(np.int32),
                        rows, rank, out, router)


def native_memory(model: NativeModel, cache: CachePolicy, room: int, decompress: bool = False,
                  scheduler: bool = False, zoom_k: int | None = None,
                  host_rows: NativeHostRows | None = None) -> NativeMemory:
    """A native memory holding `cache` (SeKV, or SeKV on the global layers beside sliding windows) with `room`
    exact rows free for decoding (or prefill chunks); its steps zoom `zoom_k` spans (default: the cache's decode
    pool). With the learned router, the model routes with the cache's router parameters: the ones it read from
    its GGUF when they are the same, else they are set from here (a packaged or freshly trained router).
    host_rows: native host rows that hold every span of `cache` already (HostRowsMirror.sync): the memory reads
    them in place, so only the device tier is exported."""
    sekv, model_layers = sekv_of(cache)
    if sorted(set(range(model.info.n_layer)) - set(model_layers)) != sorted(model.local_layers):
        raise SekvError(f"native engine: the torch memory keeps SeKV on layers {model_layers}, but the model's "
                        f"sliding-window layers are {list(model.local_layers)}")
    exported = export_memory(sekv, decompress=decompress, host_rows=None if host_rows is None else host_rows.span_rows)
    L = model.info.n_layer
    at = np.array(model_layers)

    def per_model_layer(values: np.ndarray) -> np.ndarray:
        """[n_sekv_layers, ...] -> [n_layer, ...], zeros at the sliding-window layers"""
        out = np.zeros((L, *values.shape[1:]), dtype=values.dtype)
        out[at] = values
        return out

    factored, raw = (per_model_layer(c) for c in exported.store_counts())
    pin_rows = exported.pin_rows()
    S = len(exported.span_len)
    if exported.router is not None:
        router = tuple(per_model_layer(a) for a in exported.router)
        have = model.router()
        if have is None or any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(have, router)):
            model.set_router(*router)
    memory = NativeMemory(model, exported.n_exact + room, S, exported.span_rows, exported.rank,
                          (sekv.decode_zoom_k() if zoom_k is None else zoom_k) if S else 0, sekv.cfg.summary_bias,
                          factored, raw,
                          scheduler=scheduler, learned_router=exported.router is not None,
                          union=sekv.router_kind == "union",
                          pin_rows=None if pin_rows is None else per_model_layer(pin_rows),
                          host_quant=sekv.cfg.host_quant, host_rows=host_rows)
    try:
        memory.set_spans(exported.span_start, exported.span_len)
        for i, layer in zip(model_layers, exported.layers):
            memory.set_exact(i, layer.exact_k, layer.exact_v)
            memory.set_layer_spans(i, layer.sum_k, layer.sum_v, layer.keys, layer.values)
            if layer.route_k is not None:
                memory.set_layer_routing(i, layer.route_k)
            if layer.pins is not None:
                memory.set_layer_pins(i, *layer.pins)
        if isinstance(cache, MixedLayers):
            # what the next token's window holds: the last window - 1 positions
            keep = model.info.sliding_window - 1
            for i, window in cache.windows.items():
                k, v = window.keys()[:, -keep:], window.values()[:, -keep:]
                memory.set_window(i, window.start + window.length - k.shape[1], k.cpu().numpy(), v.cpu().numpy())
    except SekvError:
        memory.close()
        raise
    memory.span_read_bytes = per_model_layer(np.stack([layer.read_bytes for layer in exported.layers])) if S else None
    return memory
