"""ctypes bindings of native/src/sekv_native.h (the library keeps llama.cpp private: it can share a
process with a stock llama-cpp-python)."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SekvError
from .build import library_path

_c_int, _c_float, _p = ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class ModelInfo(ctypes.Structure):
    _fields_ = [(name, _c_int) for name in
                ("n_layer", "n_head", "n_head_kv", "head_dim", "n_embd", "n_vocab", "n_ctx_train", "sliding_window")]


class MemoryParams(ctypes.Structure):
    _fields_ = [("exact_capacity", _c_int), ("n_spans", _c_int), ("span_rows", _c_int), ("rank", _c_int),
                ("zoom_k", _c_int), ("summary_bias", _c_float), ("n_factored", _p), ("n_raw", _p),
                ("scheduler", _c_int), ("router", _c_int), ("n_pinned", _p), ("host_quant", _c_int),
                ("host_rows", _p)]

#: sekv_memory_params.host_quant of each host tier format
HOST_QUANT_CODES = {"none": 0, "q8_0": 1, "q4_0": 2}


class SpanRows(ctypes.Structure):
    _fields_ = [("is_raw", _p), ("u", _p), ("w", _p), ("raw", _p)]


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "sekv_last_error": (ctypes.c_char_p, []),
    "sekv_model_load_on": (_p, [ctypes.c_char_p, _c_int, _c_int]),
    "sekv_model_on_gpu": (_c_int, [_p]),
    "sekv_stock_bench": (ctypes.c_int, [_p, _c_int, _c_int, _c_int, ctypes.POINTER(ctypes.c_double),
                                        ctypes.POINTER(ctypes.c_double)]),
    "sekv_model_free": (None, [_p]),
    "sekv_model_get_info": (None, [_p, ctypes.POINTER(ModelInfo)]),
    "sekv_model_layer_is_local": (_c_int, [_p, _c_int]),
    "sekv_memory_set_window": (ctypes.c_int, [_p, _c_int, _c_int, _c_int, _p, _p]),
    "sekv_memory_get_window": (ctypes.c_int, [_p, _c_int, _c_int, _c_int, _p, _p]),
    "sekv_model_set_router": (ctypes.c_int, [_p, _c_int, _p, _p]),
    "sekv_model_router_dim": (_c_int, [_p]),
    "sekv_model_get_router": (ctypes.c_int, [_p, _p, _p]),
    "sekv_memory_set_layer_routing": (ctypes.c_int, [_p, _c_int, _p]),
    "sekv_memory_set_layer_pins": (ctypes.c_int, [_p, _c_int, _c_int, _p, _p, _p]),
    "sekv_memory_create": (_p, [_p, ctypes.POINTER(MemoryParams)]),
    "sekv_memory_free": (None, [_p]),
    "sekv_memory_set_exact": (ctypes.c_int, [_p, _c_int, _c_int, _p, _p]),
    "sekv_memory_set_spans": (ctypes.c_int, [_p, _p, _p]),
    "sekv_memory_set_layer_spans": (ctypes.c_int, [_p, _c_int, _p, _p, ctypes.POINTER(SpanRows),
                                                   ctypes.POINTER(SpanRows)]),
    "sekv_decode": (ctypes.c_int, [_p, _c_int, _c_int, _p]),
    "sekv_prefill": (ctypes.c_int, [_p, _p, _c_int, _c_int, _p, _p, _p, _c_int]),
    "sekv_dequantize": (ctypes.c_int, [_c_int, _p, _p, ctypes.c_int64]),
    "sekv_memory_get_exact": (ctypes.c_int, [_p, _c_int, _c_int, _c_int, _p, _p]),
    "sekv_memory_n_exact": (_c_int, [_p]),
    "sekv_memory_bytes": (ctypes.c_int, [_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                         ctypes.POINTER(ctypes.c_uint64)]),
    "sekv_memory_last_zoom": (_c_int, [_p, _c_int, _p]),
    "sekv_host_rows_create": (_p, [_p, _c_int, _c_int]),
    "sekv_host_rows_free": (None, [_p]),
    "sekv_host_rows_reserve": (ctypes.c_int, [_p, _c_int]),
    "sekv_host_rows_set": (ctypes.c_int, [_p, _c_int, _c_int, _c_int, _p, _p]),
    "sekv_host_rows_count": (_c_int, [_p]),
    "sekv_host_rows_bytes": (ctypes.c_uint64, [_p]),
}

_LIB: ctypes.CDLL | None = None
_LIB_CUDA = False


def load_library(path: Path | None = None, cuda: bool = False) -> ctypes.CDLL:
    """The native library (built on first use when needed), loaded once per process; cuda: the build
    with ggml's CUDA backend (it runs CPU models too)."""
    global _LIB, _LIB_CUDA
    if _LIB is not None and cuda and not _LIB_CUDA:
        raise SekvError("native engine: this process already loaded the CPU-only library; start a new one to "
                        "use the GPU")
    if _LIB is None:
        # first use builds the library (minutes): say so on stderr rather than sit silent
        path = path or library_path(log=lambda line: print(f"[native] {line}", file=sys.stderr, flush=True),
                                    cuda=cuda)
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _LIB, _LIB_CUDA = lib, cuda
    return _LIB


def load_built_library() -> bool:
    """Load the CPU library if it is built already (never builds); whether a library is loaded now."""
    if _LIB is None:
        try:
            load_library(library_path(auto_build=False))
        except (SekvError, OSError):
            return False
    return True


def dequantize_loaded(data: np.ndarray, type_id: int, n: int) -> np.ndarray | None:
    """n values of ggml type `type_id` from their bytes `data` (contiguous) as float32 [n], by ggml, when this
    process has the native library loaded; None when it has not."""
    if _LIB is None:
        return None
    out = np.empty(n, dtype=np.float32)
    _check(_LIB, _LIB.sekv_dequantize(int(type_id), _ptr(np.ascontiguousarray(data)), _ptr(out), int(n)),
           "dequantize")
    return out


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        raise SekvError(f"native engine: {what}: {lib.sekv_last_error().decode(errors='replace')}")


def _half(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float16)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _Handle:
    """An object of the native library, freed by `free_function` on close (or when collected)."""

    free_function = ""
    handle: Any = None
    lib: ctypes.CDLL

    def close(self) -> None:
        if self.handle:
            getattr(self.lib, self.free_function)(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


class NativeModel(_Handle):
    """A GGUF model loaded by llama.cpp inside the native library."""

    free_function = "sekv_model_free"

    def __init__(self, gguf_path: str | Path, threads: int, gpu: bool = False) -> None:
        """gpu: weights and the device tier on the first GPU (a CUDA build of the library)."""
        if gpu:
            from .cuda import gpu_visible

            if not gpu_visible():  # before building or loading the CUDA library (a long build for nothing)
                raise SekvError("native engine: no GPU: nvidia-smi sees no NVIDIA GPU on this machine")
        self.lib = load_library(cuda=gpu)
        self.handle = self.lib.sekv_model_load_on(str(gguf_path).encode(), int(threads), int(gpu))
        if not self.handle:
            raise SekvError(f"native engine: {self.lib.sekv_last_error().decode(errors='replace')}")
        info = ModelInfo()
        self.lib.sekv_model_get_info(self.handle, ctypes.byref(info))
        self.info = info
        self.on_gpu = bool(self.lib.sekv_model_on_gpu(self.handle))
        #: sliding-window layers (they keep their window exactly; SeKV runs on the others)
        self.local_layers = tuple(i for i in range(info.n_layer) if self.lib.sekv_model_layer_is_local(self.handle, i))

    @property
    def router_dim(self) -> int:
        """d' of the model's learned router (read from its GGUF's sekv.* or set); 0 when it has none."""
        return int(self.lib.sekv_model_router_dim(self.handle))

    def router(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The learned router the decode graph uses: (q_proj float32 [L, D, d'], threshold_logit [L, H])."""
        dp = self.router_dim
        if dp == 0:
            return None
        i = self.info
        q_proj = np.empty((i.n_layer, i.head_dim, dp), dtype=np.float32)
        threshold = np.empty((i.n_layer, i.n_head), dtype=np.float32)
        _check(self.lib, self.lib.sekv_model_get_router(self.handle, _ptr(q_proj), _ptr(threshold)), "get_router")
        return q_proj, threshold

    def set_router(self, q_proj: np.ndarray, threshold: np.ndarray) -> None:
        """Replace the learned router: q_proj [L, D, d'], threshold_logit [L, H] (SeKV's Router parameters)."""
        i = self.info
        q_proj = np.ascontiguousarray(q_proj, dtype=np.float32)
        threshold = np.ascontiguousarray(threshold, dtype=np.float32)
        if q_proj.ndim != 3 or q_proj.shape[:2] != (i.n_layer, i.head_dim) or threshold.shape != (i.n_layer, i.n_head):
            raise SekvError(f"native engine: router shapes {q_proj.shape}, {threshold.shape} do not fit the model "
                            f"(q_proj [{i.n_layer}, {i.head_dim}, d'], threshold [{i.n_layer}, {i.n_head}])")
        _check(self.lib, self.lib.sekv_model_set_router(self.handle, q_proj.shape[2], _ptr(q_proj), _ptr(threshold)),
               "set_router")

    def stock_bench(self, n_context: int, n_decode: int, flash_attn: int = -1) -> tuple[float, float]:
        """Stock llama.cpp (full f16 KV) on this model: (prefill, decode) tokens/s after n_context
        ordinary tokens; flash_attn -1 = llama.cpp's default, 0 = off, 1 = on."""
        prefill, decode = ctypes.c_double(), ctypes.c_double()
        _check(self.lib, self.lib.sekv_stock_bench(self.handle, int(n_context), int(n_decode), int(flash_attn),
                                                   ctypes.byref(prefill), ctypes.byref(decode)), "stock_bench")
        return prefill.value, decode.value


@dataclass
class StoreRows:
    """One layer's keys or values of every span: is_raw [S]; u [F, KV, l, R]; w [F, KV, D, R];
    raw [n_raw, KV, l, D] (keys) or [n_raw, KV, D, l] (values)."""

    is_raw: np.ndarray
    u: np.ndarray
    w: np.ndarray
    raw: np.ndarray

    def as_struct(self) -> tuple[SpanRows, list[np.ndarray]]:
        arrays = [np.ascontiguousarray(self.is_raw, dtype=np.int32), _half(self.u), _half(self.w), _half(self.raw)]
        return SpanRows(*(_ptr(a) for a in arrays)), arrays


class NativeHostRows(_Handle):
    """A host tier of raw span rows that outlives the memories reading it (sekv_host_rows in sekv_native.h): spans
    are added as a document is read, and each new memory borrows them instead of copying the tier."""

    free_function = "sekv_host_rows_free"

    def __init__(self, model: NativeModel, span_rows: int, host_quant: str = "none") -> None:
        self.model = model
        self.lib = model.lib
        self.span_rows = int(span_rows)
        self.host_quant = host_quant
        self.handle = self.lib.sekv_host_rows_create(model.handle, self.span_rows, HOST_QUANT_CODES[host_quant])
        if not self.handle:
            raise SekvError(f"native engine: {self.lib.sekv_last_error().decode(errors='replace')}")

    def reserve(self, n_spans: int) -> None:
        _check(self.lib, self.lib.sekv_host_rows_reserve(self.handle, int(n_spans)), "host_rows_reserve")

    def set(self, layer: int, first: int, k: np.ndarray, v: np.ndarray) -> None:
        """Spans [first, first + n) of a global layer: k [n, KV, l, D] (rotated), v [n, KV, D, l]; later ones go."""
        k, v = _half(k), _half(v)
        if k.shape[0] != v.shape[0]:
            raise SekvError("native engine: host rows need as many value spans as key spans")
        _check(self.lib, self.lib.sekv_host_rows_set(self.handle, int(layer), int(first), k.shape[0], _ptr(k), _ptr(v)),
               "host_rows_set")

    @property
    def count(self) -> int:
        """Spans every global layer holds."""
        return int(self.lib.sekv_host_rows_count(self.handle))

    def bytes(self) -> int:
        """Bytes of its buffer (room allocated, held or not)."""
        return int(self.lib.sekv_host_rows_bytes(self.handle))


@dataclass(frozen=True)
class NativeBytes:
    device: int
    host: int
    compute: int


class NativeMemory(_Handle):
    """One document's SeKV memory in native buffers; see sekv_native.h for the layouts."""

    free_function = "sekv_memory_free"

    def __init__(self, model: NativeModel, exact_capacity: int, n_spans: int, span_rows: int, rank: int,
                 zoom_k: int, summary_bias: float, n_factored: np.ndarray, n_raw: np.ndarray,
                 scheduler: bool = False, learned_router: bool = False, pin_rows: np.ndarray | None = None,
                 union: bool = False, host_quant: str = "none", host_rows: NativeHostRows | None = None) -> None:
        """n_factored, n_raw [n_layer, 2]: spans each layer stores as factors / raw, keys then values.
        scheduler: step through ggml's multi-backend scheduler even on the CPU (a GPU model always does).
        learned_router: route with the model's learned router (set each layer's routing keys too); with union, only
        the second half of each pool (the first by the training-free rule).
        pin_rows [n_layer]: room for each layer's pinned rows (question-time selection), None: no pins.
        host_quant: the host tier's format, "none" (f16), "q8_0" or "q4_0" (quantized from the f16 rows set).
        host_rows: read every span from these rows (all raw; the memory keeps them alive) instead of its own tier."""
        self.model = model
        self.lib = model.lib
        counts = [np.ascontiguousarray(a, dtype=np.int32).reshape(-1) for a in (n_factored, n_raw)]
        if any(c.size != 2 * model.info.n_layer for c in counts):
            raise SekvError("native engine: n_factored / n_raw need one count per layer for keys and values")
        self._pin_rows = None if pin_rows is None else np.ascontiguousarray(pin_rows, dtype=np.int32).reshape(-1)
        if self._pin_rows is not None and self._pin_rows.size != model.info.n_layer:
            raise SekvError("native engine: pin_rows needs one count per layer")
        params = MemoryParams(exact_capacity, n_spans, span_rows, rank, zoom_k, summary_bias,
                              _ptr(counts[0]), _ptr(counts[1]), int(scheduler),
                              2 if learned_router and union else int(learned_router),
                              None if self._pin_rows is None else _ptr(self._pin_rows), HOST_QUANT_CODES[host_quant],
                              None if host_rows is None else host_rows.handle)
        self.host_rows = host_rows  # the rows must outlive the memory
        self.handle = self.lib.sekv_memory_create(model.handle, ctypes.byref(params))
        if not self.handle:
            raise SekvError(f"native engine: {self.lib.sekv_last_error().decode(errors='replace')}")
        self.n_spans = n_spans
        # host bytes [n_layer, S] one KV head's zoom into each span reads (set by whoever fills the memory)
        self.span_read_bytes: np.ndarray | None = None
        self.router_dim = model.router_dim if learned_router else 0
        self._logits = np.empty(model.info.n_vocab, dtype=np.float32)

    def set_exact(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [KV, n, D] (k post-RoPE)."""
        k, v = _half(k), _half(v)
        _check(self.lib, self.lib.sekv_memory_set_exact(self.handle, layer, k.shape[1], _ptr(k), _ptr(v)),
               "set_exact")

    def set_spans(self, start: np.ndarray, length: np.ndarray) -> None:
        start = np.ascontiguousarray(start, dtype=np.int32)
        length = np.ascontiguousarray(length, dtype=np.int32)
        _check(self.lib, self.lib.sekv_memory_set_spans(self.handle, _ptr(start), _ptr(length)), "set_spans")

    def set_layer_spans(self, layer: int, sum_k: np.ndarray, sum_v: np.ndarray, keys: "StoreRows | None",
                        values: "StoreRows | None") -> None:
        """sum_k, sum_v [KV, S, D]; keys, values: the spans' rows (None for a memory on host_rows)."""
        sum_k, sum_v = _half(sum_k), _half(sum_v)
        if keys is None or values is None:
            status = self.lib.sekv_memory_set_layer_spans(self.handle, layer, _ptr(sum_k), _ptr(sum_v), None, None)
        else:
            k_struct, k_keep = keys.as_struct()
            v_struct, v_keep = values.as_struct()
            status = self.lib.sekv_memory_set_layer_spans(self.handle, layer, _ptr(sum_k), _ptr(sum_v),
                                                          ctypes.byref(k_struct), ctypes.byref(v_struct))
            del k_keep, v_keep
        _check(self.lib, status, "set_layer_spans")

    def set_layer_routing(self, layer: int, route_k: np.ndarray) -> None:
        """route_k [KV, S, d']: the layer's unit-norm routing keys (learned router only)."""
        route_k = _half(route_k)
        want = (self.model.info.n_head_kv, self.n_spans, self.router_dim)
        if not self.router_dim or route_k.shape != want:
            raise SekvError(f"native engine: routing keys of shape {route_k.shape}, this memory takes {want}"
                            + ("" if self.router_dim else " (it was made without the learned router)"))
        _check(self.lib, self.lib.sekv_memory_set_layer_routing(self.handle, layer, _ptr(route_k)), "set_layer_routing")

    def set_layer_pins(self, layer: int, k: np.ndarray, v: np.ndarray, pinned: np.ndarray) -> None:
        """k, v [KV, n, D] (k post-RoPE): the rows of `layer`'s pinned spans; pinned [S] (bool): which spans."""
        k, v = _half(k), _half(v)
        pinned = np.ascontiguousarray(pinned, dtype=np.int32)
        if pinned.shape != (self.n_spans,):
            raise SekvError(f"native engine: a pin mask of shape {pinned.shape}, this memory has {self.n_spans} spans")
        _check(self.lib, self.lib.sekv_memory_set_layer_pins(self.handle, layer, k.shape[1], _ptr(k), _ptr(v),
                                                             _ptr(pinned)), "set_layer_pins")

    def decode(self, token: int, position: int) -> np.ndarray:
        """Logits [vocab] after `token` at `position` (a copy)."""
        _check(self.lib, self.lib.sekv_decode(self.handle, int(token), int(position), _ptr(self._logits)), "decode")
        return self._logits.copy()

    def prefill(self, tokens: list[int] | np.ndarray, position: int, surprisal: bool = True,
                score_rows: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """A prefill chunk of n tokens from `position` on, appended to the exact rows: (nll float32 [n - 1],
        -log p(tokens[i + 1] | up to i), or None when not asked for; the last token's logits [vocab]).
        score_rows: the vocabulary ids [R] the surprisal normalises over (the chunk's tokens among them; None: all)."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        nll = np.empty(max(ids.size - 1, 1), dtype=np.float32) if surprisal else None
        rows = None if score_rows is None else np.ascontiguousarray(score_rows, dtype=np.int32).reshape(-1)
        _check(self.lib, self.lib.sekv_prefill(self.handle, _ptr(ids), int(ids.size), int(position),
                                               None if nll is None else _ptr(nll), _ptr(self._logits),
                                               None if rows is None else _ptr(rows),
                                               0 if rows is None else int(rows.size)), "prefill")
        return (None if nll is None else nll[: ids.size - 1]), self._logits.copy()

    def get_exact(self, layer: int, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact rows [first, first + n) of `layer`: k, v float16 [KV, n, D] (k post-RoPE)."""
        info = self.model.info
        k = np.empty((info.n_head_kv, n, info.head_dim), dtype=np.float16)
        v = np.empty_like(k)
        _check(self.lib, self.lib.sekv_memory_get_exact(self.handle, layer, int(first), int(n), _ptr(k), _ptr(v)),
               "get_exact")
        return k, v

    def set_window(self, layer: int, position: int, k: np.ndarray, v: np.ndarray) -> None:
        """A sliding-window layer's rows for positions [position, position + n): k, v [KV, n, D] (k post-RoPE)."""
        k, v = _half(k), _half(v)
        _check(self.lib, self.lib.sekv_memory_set_window(self.handle, layer, int(position), k.shape[1], _ptr(k),
                                                         _ptr(v)), "set_window")

    def get_window(self, layer: int, position: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """A sliding-window layer's rows for positions [position, position + n): k, v float16 [KV, n, D]."""
        info = self.model.info
        k = np.empty((info.n_head_kv, n, info.head_dim), dtype=np.float16)
        v = np.empty_like(k)
        _check(self.lib, self.lib.sekv_memory_get_window(self.handle, layer, int(position), int(n), _ptr(k), _ptr(v)),
               "get_window")
        return k, v

    @property
    def n_exact(self) -> int:
        return int(self.lib.sekv_memory_n_exact(self.handle))

    def bytes(self) -> NativeBytes:
        d, h, c = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.sekv_memory_bytes(self.handle, ctypes.byref(d), ctypes.byref(h), ctypes.byref(c))
        return NativeBytes(d.value, h.value, c.value)

    def last_zoom(self, layer: int) -> np.ndarray:
        """Spans rebuilt by `layer` in the last step, int32 [KV, k] (k = 0 when none; -1: a slot the
        learned router left empty)."""
        KV = self.model.info.n_head_kv
        out = np.empty(KV * max(self.n_spans, 1), dtype=np.int32)
        k = self.lib.sekv_memory_last_zoom(self.handle, layer, _ptr(out))
        return out[: KV * max(k, 0)].reshape(KV, max(k, 0))

