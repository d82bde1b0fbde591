"""`llama.cpp-stock`: llama-cpp-python as released, the baseline a user would otherwise pick.

The engine drives a `llama_cpp.Llama` with token ids only (`Llama.eval`), never with its own prompt
handling, so it sees exactly the ids the shared `Tokenizer` / `PromptBuilder` produce, the same ids
the torch engine sees. Methods: "full" (f16 KV, llama.cpp's defaults otherwise), "quant-q8_0" and
"quant-q4_0" (llama.cpp's own quantized KV cache). Flash attention is on for every method, as llama.cpp's own
tools turn it on (llama-cpp-python's default leaves it off).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.base import MemoryReport
from ..errors import ModelError, SekvError
from ..models.gguf_file import GGUFModelFile
from ..models.tokenizer import Tokenizer, _quiet_stderr
from .base import Engine, EngineOptions

#: method -> (ggml type name for K and V, None = llama.cpp's default f16)
METHODS: dict[str, str | None] = {"full": None, "quant-q8_0": "Q8_0", "quant-q4_0": "Q4_0"}

#: ggml type -> (values per block, bytes per block) of one KV row (ggml_row_size)
_TYPE_BLOCKS: dict[str, tuple[int, int]] = {"F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18)}

_METHOD_OPTIONS = ("n_ctx",)


def kv_row_bytes(type_name: str, n_values: int) -> int:
    """Bytes of one cached K (or V) row of `n_values` values in ggml type `type_name`."""
    block, size = _TYPE_BLOCKS[type_name]
    if n_values % block:
        raise SekvError(f"a KV row of {n_values} values cannot be stored as {type_name} (blocks of {block})")
    return n_values // block * size


class LlamaCppStockEngine(Engine):
    name = "llama.cpp-stock"

    def __init__(self, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> None:
        import llama_cpp

        if options.method not in METHODS:
            raise SekvError(f"engine llama.cpp-stock supports only the methods {', '.join(METHODS)} "
                            f"(got '{options.method}'); compressing methods need --engine torch")
        if options.budget is not None:
            raise SekvError(f"engine llama.cpp-stock keeps every token ({options.method}); it takes no --budget "
                            "(compressing methods need --engine torch)")
        unknown = sorted(set(options.method_options) - set(_METHOD_OPTIONS))
        if unknown:
            raise SekvError(f"engine llama.cpp-stock: unknown option(s) {', '.join(unknown)} "
                            f"(available: {', '.join(_METHOD_OPTIONS)})")
        n_ctx = options.method_options.get("n_ctx")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise SekvError(f"engine llama.cpp-stock: n_ctx must be a positive integer, got {n_ctx!r}")
        config = GGUFModelFile(gguf_path).config
        super().__init__(config, tokenizer, options)
        if n_ctx is None:
            n_ctx = config.context_length  # llama.cpp allocates the KV buffer for all of it up front
        threads = options.threads or os.cpu_count() or 1
        if options.device == "cpu":
            gpu_layers = 0
        elif options.device == "auto" or options.device.startswith("cuda"):
            gpu_layers = -1 if llama_cpp.llama_supports_gpu_offload() else 0
        else:
            raise SekvError(f"engine llama.cpp-stock: unknown device '{options.device}' (cpu, cuda, auto)")
        self.kv_type = METHODS[options.method] or "F16"
        # flash attention as llama.cpp's own tools run it (`-fa auto`: on wherever the backend has the kernel);
        # llama-cpp-python defaults to off, which read Gemma 3 at 8K at 287 instead of 490 tok/s here
        kwargs: dict[str, Any] = {"flash_attn": True}
        if METHODS[options.method] is not None:
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{self.kv_type}")
            kwargs.update(type_k=ggml_type, type_v=ggml_type)
        self.gpu_layers = gpu_layers
        try:
            with _quiet_stderr():
                self._llm = llama_cpp.Llama(
                    str(gguf_path), n_ctx=n_ctx, n_batch=options.chunk_size, n_ubatch=options.chunk_size,
                    n_threads=threads, n_threads_batch=threads, n_gpu_layers=gpu_layers,
                    logits_all=False, verbose=False, **kwargs)
        except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError with little detail
            raise ModelError(f"llama.cpp could not load {gguf_path} ({options.method}, n_ctx={n_ctx}): {exc}") from exc
        self._n_ctx = int(self._llm.n_ctx())
        self._n_vocab = int(self._llm.n_vocab())

    # -- helpers --------------------------------------------------------------------------------
    def _memory_handle(self):
        import llama_cpp

        return llama_cpp.llama_get_memory(self._llm.ctx)

    def _logits_rows(self, rows: int | None = None) -> np.ndarray:
        """The logits of the last decoded batch, copied as float32: its last output row [1, vocab]
        when `rows` is None, else all `rows` output rows in batch order [rows, vocab]."""
        import llama_cpp

        if rows is None:
            ptr, rows = llama_cpp.llama_get_logits_ith(self._llm.ctx, -1), 1
        else:
            ptr = llama_cpp.llama_get_logits(self._llm.ctx)
        if not ptr:
            raise SekvError("llama.cpp returned no logits")
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(rows * self._n_vocab,))
        return np.array(flat, dtype=np.float32, copy=True).reshape(rows, self._n_vocab)

    # -- Engine ---------------------------------------------------------------------------------
    def _forward(self, tokens: list[int], prefill: bool) -> np.ndarray:
        # Llama.eval appends at llm.n_tokens, first dropping KV cells at positions >= n_tokens
        # (llama_memory_seq_rm), and splits into n_batch pieces itself.
        self._llm.n_tokens = self.n_tokens
        try:
            self._llm.eval(tokens)
        except Exception as exc:
            raise SekvError(f"llama.cpp failed to evaluate {len(tokens)} tokens at position {self.n_tokens}: "
                            f"{exc}") from exc
        return self._logits_rows()[0]

    def reset(self) -> None:
        import llama_cpp

        self._llm.reset()
        llama_cpp.llama_memory_clear(self._memory_handle(), True)
        self.n_tokens = 0
        self._last_logits = None

    def mark(self) -> tuple[int, np.ndarray | None]:
        return (self.n_tokens, self._last_logits)

    def rollback(self, mark: tuple[int, np.ndarray | None]) -> None:
        import llama_cpp

        n, logits = mark
        if n > self.n_tokens:
            raise SekvError("cannot roll back to a mark that lies after the current context")
        llama_cpp.llama_memory_seq_rm(self._memory_handle(), 0, n, -1)  # eval would do it lazily too
        self._llm.n_tokens = n
        self.n_tokens = n
        self._last_logits = logits

    def max_context(self) -> int:
        return self._n_ctx

    def memory(self) -> MemoryReport:
        """The KV buffer llama.cpp allocates up front for all n_ctx cells: n_ctx x n_layers x
        (K row + V row), a row being n_kv_heads x head_dim values in the cache type (f16: 2 bytes
        per value; q8_0: 34 bytes per 32; q4_0: 18 per 32).

        Checked against llama.cpp's own log for SmolLM2-135M (n_ctx 8192, 30 layers, 3 KV heads x 64):
        f16 "KV buffer size = 180.00 MiB", q8_0 "95.62 MiB", q4_0 "50.62 MiB", which is exactly what
        this formula gives (188743680, 100270080 and 53084160 bytes). All of it is allocated whatever
        the number of tokens, so device bytes = peak = that buffer; nothing lives in host RAM.
        """
        cfg = self.config
        row = kv_row_bytes(self.kv_type, cfg.n_kv_heads * cfg.head_dim)
        per_layer = self._n_ctx * 2 * row
        total = per_layer * cfg.n_layers
        return MemoryReport(
            tokens=self.n_tokens,
            device_bytes=total,
            device_peak_bytes=total,
            host_bytes=0,
            full_kv_bytes=cfg.full_kv_bytes(self.n_tokens),
            full_kv_held_bytes=cfg.full_kv_held_bytes(self.n_tokens),
            device_per_layer=[per_layer] * cfg.n_layers,
            host_per_layer=[0] * cfg.n_layers,
        )

    def score(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Teacher forcing on the engine's own (reset) context: each batch of n_batch tokens is
        decoded with logits requested for every position (what logits_all=True does), then
        log-softmax in float64. Leaves the engine reset."""
        if len(tokens) > self._n_ctx:
            raise SekvError(f"cannot score {len(tokens)} tokens: the llama.cpp context holds {self._n_ctx}")
        self.reset()
        llm = self._llm
        step = llm.n_batch
        logprobs, argmax = [], []
        try:
            for i in range(0, len(tokens), step):
                chunk = tokens[i: i + step]
                llm._batch.set_batch(batch=chunk, n_past=i, logits_all=True)
                llm._ctx.decode(llm._batch)
                nxt = np.asarray(tokens[i + 1: i + 1 + len(chunk)], dtype=np.int64)
                if not len(nxt):
                    break
                logits = self._logits_rows(len(chunk))[: len(nxt)].astype(np.float64)
                top = logits.max(axis=1, keepdims=True)
                lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
                logprobs.append(logits[np.arange(len(nxt)), nxt] - lse)
                argmax.append(logits.argmax(axis=1))
        except SekvError:
            raise
        except Exception as exc:
            raise SekvError(f"llama.cpp failed while scoring: {exc}") from exc
        finally:
            self.reset()
        if not logprobs:
            return np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
        return np.concatenate(logprobs), np.concatenate(argmax)

    def close(self) -> None:
        """Free llama.cpp's model and context now (otherwise the garbage collector does it)."""
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None
