"""`--engine llama.cpp`: SeKV in the native library (llama.cpp's loader and quantized kernels).

With `prefill=native` the document is read natively, one chunk per graph: each chunk attends to
the memory built so far and causally to itself, and hands back its K/V rows and its tokens' surprisal; the
torch SeKV memory does the bookkeeping on the host (segmentation, span factors, summaries: no forward pass)
and the next chunk's native memory is made from it. A question's chunk (select=question: an exact pass over
every span that chooses the answer's pins) is still read by the torch engine. Every generated token is
decoded natively. Tokens decoded natively are fed back to the torch memory before its next prefill (or when
the native exact rows are full), so both hold the same conversation: with native prefill as rows the native
memory computed, otherwise read again by the torch model. `prefill=torch` reads everything with the
torch engine; the default (`auto`) reads natively where that was measured faster (Gemma 3), with torch otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache.base import MemoryReport
from ..errors import SekvError
from ..models.tokenizer import Tokenizer
from .base import Engine, EngineOptions
from .torch_engine import TorchEngine, resolve_device

# exact rows the native memory keeps free for generated tokens before it folds them back into torch
DECODE_ROOM = 256
# where span detail lives in the native host tier: "rows" (rebuilt from the factors once, at import: each
# step reads only the zoomed rows) or "factors" (the SVD factors; each step rebuilds the zoomed spans).
# On a CPU the per-step rebuild dominates decode time (measured: docs/RESULTS.md), so "rows" is the default.
HOST_FORMS = ("rows", "factors")
#: who reads the document's chunks: the native graph (the torch memory only keeps the books) or the torch engine;
#: "auto" picks by architecture
PREFILLS = ("auto", "native", "torch")
#: where "auto" reads natively: where it was measured faster (docs/RESULTS.md "Stock llama.cpp with flash
#: attention"): Gemma 3 (8K: about 10x the torch engine's prefill); SmolLM2 at 7.7K still reads about 10% faster in
#: the torch engine
NATIVE_PREFILL_ARCHITECTURES = ("gemma3",)




@lru_cache(maxsize=2)
def load_native_model(path: str, threads: int, gpu: bool) -> Any:
    """The model in the native library, loaded once per process (as the torch engine's weights are): the
    bench, the chat app's /method and a new question's engine would each load the weights again."""
    from ..native.bindings import NativeModel

    return NativeModel(path, threads, gpu=gpu)


class LlamaCppSekvEngine(Engine):
    name = "llama.cpp"

    def __init__(self, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> None:
        if options.method != "sekv":
            raise SekvError(f"engine 'llama.cpp' runs method 'sekv' (got '{options.method}'); use "
                            f"--engine llama.cpp-stock for stock llama.cpp or --engine torch for other methods")
        from ..native.memory_export import supported

        method_options = dict(options.method_options)
        # the native memory adds an answer's rows until its decode room fills: the pins leave room for them
        method_options.setdefault("answer_room", DECODE_ROOM)
        self.host_form = method_options.pop("host", "rows")
        if self.host_form not in HOST_FORMS:
            raise SekvError(f"engine 'llama.cpp': host must be one of {', '.join(HOST_FORMS)}, got {self.host_form!r}")
        self.prefill = method_options.pop("prefill", "auto")
        if self.prefill not in PREFILLS:
            raise SekvError(f"engine 'llama.cpp': prefill must be one of {', '.join(PREFILLS)}, got {self.prefill!r}")
        options = dataclasses.replace(options, method_options=method_options)
        from ..native.bindings import load_library

        load_library(cuda=resolve_device(options.device).startswith("cuda"))  # before the torch weights: ggml reads them
        self.reference = TorchEngine(gguf_path, tokenizer, options)
        super().__init__(self.reference.config, tokenizer, options)
        if self.prefill == "auto":
            self.prefill = "native" if self.config.architecture in NATIVE_PREFILL_ARCHITECTURES else "torch"
        why = supported(self.reference.cache)
        if why is not None:
            raise SekvError(f"engine 'llama.cpp' does not support {why} yet; use --engine torch")
        self.notices = self.reference.notices
        # the native side follows the device the torch side prefills on ("auto" picks CUDA when torch sees it)
        on_gpu = torch.device(self.reference.device).type == "cuda"
        self.native_model = load_native_model(str(gguf_path), options.threads or os.cpu_count() or 1, on_gpu)
        self.native: Any = None  # NativeMemory, built from the torch memory when decoding starts
        from ..native.host_rows import HostRowsMirror

        # host=rows: every span's rows, kept between native memories (each chunk's and question's borrows them)
        self.host_rows = HostRowsMirror(self.native_model) if self.host_form == "rows" else None
        self.pending: list[int] = []  # decoded natively, not yet in the torch memory
        self.pending_nll: list[float] = []  # each pending token's surprisal under the logits that chose it
        self._native_last: np.ndarray | None = None  # the last native decode step's logits
        self._score_rows: np.ndarray | None = None  # the surprisal shortlist while decoding natively
        self._native_peak = 0

    @property
    def sekv(self) -> Any:
        """The torch engine's SeKV memory (on a model with sliding windows, the global layers' beside the windows;
        the torch engine makes a new one on reset)."""
        from ..native.memory_export import sekv_of

        return sekv_of(self.reference.cache)[0]

    @property
    def sekv_layers(self) -> list[int]:
        """The model layer of each of SeKV's layers."""
        from ..native.memory_export import sekv_of

        return sekv_of(self.reference.cache)[1]

    def _within_window(self, tokens: int) -> int:
        """A torch chunk of at most `tokens`, and on a model with sliding windows at most a window (their rule)."""
        window = self.config.sliding_window
        return min(tokens, window) if window else tokens

    # -- keeping the two memories in step ---------------------------------------------------------
    def _fold_back(self) -> None:
        """Feed the natively decoded tokens to the torch memory; the native memory is rebuilt from it at the next
        decode. With native prefill their rows come from the native memory (no forward pass), as a document's do;
        otherwise the torch model reads them again (one chunk)."""
        if self.pending:
            tokens, nll, self.pending, self.pending_nll = self.pending, self.pending_nll, [], []
            self.reference.n_tokens = self.n_tokens - len(tokens)
            if self.prefill == "native":
                self._fold_back_rows(tokens, nll)
            else:
                self._replay(tokens)
        self.reference.n_tokens = self.n_tokens
        self._drop_native()

    @torch.inference_mode()  # the torch memory's buffers are inference tensors (made under the torch engine's)
    def _fold_back_rows(self, tokens: list[int], nll: list[float]) -> None:
        """The pending tokens' rows, read from the native memory that decoded them, into the torch memory from
        reference.n_tokens on, in the pieces a replay takes; their surprisal from the decode steps' logits."""
        from ..models.transformer import ChunkScores

        ref, cache, sekv = self.reference, self.reference.cache, self.sekv
        first_row = self.native.n_exact - len(tokens)
        with sekv.replaying():
            done = 0
            while done < len(tokens):
                n = self._within_window(min(sekv.replay_chunk_tokens(), len(tokens) - done))
                cache.begin_chunk(torch.arange(ref.n_tokens, ref.n_tokens + n, device=ref.device), is_prefill=True)
                self._take_rows(self.native, first_row + done, n)
                # `last` is not read when folding (surprisal comes from nll and first_nll); the answer's tokens join
                # the surprisal shortlist as a replayed chunk's would
                cache.score_rows(torch.tensor(tokens[done: done + n], dtype=torch.long))
                scores = ChunkScores(torch.from_numpy(self._native_last)[None],
                                     torch.tensor(nll[done + 1: done + n], dtype=torch.float32), first_nll=nll[done])
                cache.end_chunk(scores, torch.tensor(tokens[done: done + n], dtype=torch.long))
                ref.n_tokens += n
                done += n
        ref._last_logits = self._native_last

    def _take_rows(self, memory: Any, first_row: int, n: int) -> None:
        """Rows of n tokens at reference.n_tokens on, computed by `memory` (from its exact row first_row; a
        sliding-window layer's by position), into the torch memory's pending rows and windows."""
        ref, cache = self.reference, self.reference.cache
        for layer, i in zip(self.sekv.layers, self.sekv_layers):
            k, v = memory.get_exact(i, first_row, n)
            layer.pend_k.append(torch.from_numpy(k).to(ref.device))
            layer.pend_v.append(torch.from_numpy(v).to(ref.device))
        for i in self.native_model.local_layers:
            k, v = memory.get_window(i, ref.n_tokens, n)
            cache.add_window_rows(i, torch.from_numpy(k).to(ref.device), torch.from_numpy(v).to(ref.device))

    def _replay(self, tokens: list[int]) -> np.ndarray:
        """Feed natively decoded tokens to the torch memory from reference.n_tokens on, in pieces that keep
        its device tier where the decode steps kept it; the last piece's logits."""
        with self.sekv.replaying():
            while tokens:
                n = self._within_window(self.sekv.replay_chunk_tokens())
                piece, tokens = tokens[:n], tokens[n:]
                logits = self.reference._forward(piece, prefill=True)
                self.reference.n_tokens += len(piece)
        return logits

    def _drop_native(self) -> None:
        if self.native is not None:
            self.native.close()
            self.native = None

    def _synced_host_rows(self) -> Any:
        """The host rows holding every span of the torch memory now (None with host=factors); no native memory may
        be alive (a sync may move the rows)."""
        if self.host_rows is None:
            return None
        return self.host_rows.sync(self.sekv, self.sekv_layers)

    def _import(self) -> None:
        from ..native.memory_export import native_memory

        cache = self.reference.cache
        # folding back the room's tokens is one torch chunk
        room = self._within_window(min(DECODE_ROOM, self.sekv.chunk_tokens))
        self.native = native_memory(self.native_model, cache, room, host_rows=self._synced_host_rows())
        self.native_capacity = self.native.n_exact + room
        rows = cache.score_rows(torch.zeros(0, dtype=torch.long))  # the shortlist as it stands (sorted ids)
        self._score_rows = None if rows is None else rows.numpy()

    # -- Engine -----------------------------------------------------------------------------------
    def _forward(self, tokens: list[int], prefill: bool) -> np.ndarray:
        full = self.native is not None and self.native.n_exact + 1 >= self.native_capacity
        if prefill or len(tokens) != 1 or full:
            if full:  # the pending tokens and this one fit one torch chunk (room <= chunk_tokens)
                tokens, self.pending, self.pending_nll = self.pending + tokens, [], []
                self._drop_native()
            else:
                self._fold_back()
            if full:  # the answer goes on: its tokens so far and this one, fed back under the answer's pins
                self.reference.n_tokens = self.n_tokens + 1 - len(tokens)
                return self._replay(tokens)
            self.reference.n_tokens = self.n_tokens
            logits = self._prefill_chunk(tokens)
            self.reference.n_tokens = self.n_tokens + len(tokens)
            return logits
        if self.native is None:
            self._import()
        if self.prefill == "native":  # the fold-back's surprisal (the torch model reads the tokens otherwise)
            self.pending_nll.append(self._token_surprisal(tokens[0]))
        logits = self.native.decode(tokens[0], self.n_tokens)
        self._native_last = logits
        self._record_zoom()
        self.pending.append(tokens[0])
        return logits

    def _token_surprisal(self, token: int) -> float:
        """-log p(token) under the logits that chose it (0 when nothing predicted it), normalised over the
        memory's surprisal rows as the import found them, with the token among them. In numpy: a torch op per
        decode step leaves torch's OpenMP workers spinning beside ggml's threads (17% of a Gemma step's CPU)."""
        before = self._native_last if self.pending else self.reference._last_logits
        if before is None:
            return 0.0
        rows = self._score_rows
        values = before if rows is None else before[rows]
        top = float(values.max())
        total = float(np.exp(values - top).sum())
        if rows is not None:
            at = int(np.searchsorted(rows, token))
            if at == rows.size or rows[at] != token:  # a token the shortlist lacks joins its normaliser
                total += float(np.exp(before[token] - top))
        return float(top + np.log(total) - before[token])

    def _prefill_chunk(self, tokens: list[int]) -> np.ndarray:
        """One prefill chunk at reference.n_tokens: read natively unless it is a question's (or prefill=torch)."""
        ref, cache, sekv = self.reference, self.reference.cache, self.sekv
        # the spans the last chunk made join the host rows now, while the document is read, not at the question
        host_rows = self._synced_host_rows()
        if self.prefill == "torch" or sekv.is_question_chunk(is_prefill=True):
            return ref._forward(tokens, prefill=True)
        from ..models.transformer import ChunkScores
        from ..native.memory_export import native_memory

        cache.begin_chunk(torch.arange(ref.n_tokens, ref.n_tokens + len(tokens), device=ref.device), is_prefill=True)
        # the memory as the torch books hold it now, with room for the chunk's rows; its zoom pool is the chunk's.
        # Its spans are the host rows (with host=factors: the factors, rebuilt in the graph)
        memory = native_memory(self.native_model, cache, len(tokens) + 1, zoom_k=sekv._step_zoom_k, host_rows=host_rows)
        rows = cache.score_rows(torch.tensor(tokens, dtype=torch.long))
        try:
            first = memory.n_exact
            nll, logits = memory.prefill(tokens, ref.n_tokens, score_rows=None if rows is None else rows.numpy())
            self._take_rows(memory, first, len(tokens))
            self._record_zoom(memory, decode_step=False)
        finally:
            memory.close()
        scores = ChunkScores(torch.from_numpy(logits)[None], torch.from_numpy(nll), rows=rows)
        cache.end_chunk(scores.predicted_by(ref._last_logits, tokens[0]), torch.tensor(tokens, dtype=torch.long))
        ref._last_logits = logits
        return logits

    def _record_zoom(self, memory: Any = None, decode_step: bool = True) -> None:
        """After a native graph ran (a decode step of the native memory, or a prefill chunk's `memory`): its zoom
        choices into the torch memory's observations (the document map), the host bytes they read into its
        host-read count, and its device tier plus compute buffer into the native peak."""
        memory = self.native if memory is None else memory
        cache = self.sekv
        reads = 0
        for j, layer in enumerate(self.sekv_layers):  # j: the layer as SeKV numbers it
            chosen = memory.last_zoom(layer)
            if chosen.size:
                cache._zoom_events.append((j, torch.from_numpy(chosen.astype(np.int64))))
                reads += int(memory.span_read_bytes[layer][chosen[chosen >= 0]].sum())
        if decode_step:
            cache.host_reads.steps += 1
        cache.host_reads.count(reads, decode_step=decode_step)
        used = memory.bytes()
        self._native_peak = max(self._native_peak, used.device + used.compute)

    def finish_prefill(self) -> None:
        self._fold_back()
        self.reference.finish_prefill()
        # the torch memory may have read the question again (SeKV's reread): the answer starts from its logits
        self._last_logits = self.reference._last_logits

    def reset(self) -> None:
        self.pending, self.pending_nll = [], []
        self._drop_native()
        if self.host_rows is not None:
            self.host_rows.close()
        self.reference.reset()
        self.n_tokens = 0
        self._last_logits = None
        self._native_peak = 0

    def mark(self) -> Any:
        self._fold_back()
        return (self.n_tokens, self._last_logits, self.reference.mark())

    def rollback(self, mark: Any) -> None:
        self.pending, self.pending_nll = [], []
        self._drop_native()
        self.n_tokens, self._last_logits, ref_mark = mark
        self.reference.rollback(ref_mark)

    def memory(self) -> MemoryReport:
        """The native memory's real buffers once decoding has started (device tier: exact rows, span
        summaries and metadata, plus the step's compute buffer at its peak; host tier: span rows and
        factors), plus the torch memory it was imported from, which stays alive beside it (answers fold back
        into it): in host RAM when torch runs on the CPU, on the device otherwise. Before decoding, the torch
        memory that will be imported, and the host rows kept for it."""
        ref = self.reference.memory()
        rows = 0 if self.host_rows is None else self.host_rows.bytes()
        if self.native is None:
            return ref if not rows else dataclasses.replace(ref, host_bytes=ref.host_bytes + rows, host_per_layer=[])
        b = self.native.bytes()
        on_device = torch.device(self.reference.device).type != "cpu"
        torch_device = ref.device_bytes if on_device else 0
        return MemoryReport(tokens=self.n_tokens, device_bytes=b.device + torch_device,
                            device_peak_bytes=max(ref.device_peak_bytes, self._native_peak) + torch_device,
                            host_bytes=b.host + rows + ref.host_bytes + (0 if on_device else ref.device_bytes),
                            full_kv_bytes=self.config.full_kv_bytes(self.n_tokens),
                            host_reads=ref.host_reads, full_kv_held_bytes=ref.full_kv_held_bytes,
                            checkpoint_bytes=ref.checkpoint_bytes)

    def score(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        self.reset()
        return self.reference.score(tokens)

    def export_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self._fold_back()
        return self.reference.export_state()

    def import_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        self.reset()
        self.reference.import_state(tensors, meta)
        self.n_tokens = self.reference.n_tokens
        self._last_logits = self.reference._last_logits

    def reserve(self, n_tokens: int) -> None:
        self.reference.reserve(n_tokens)

    def reset_observations(self) -> None:
        self.reference.reset_observations()

    def room_tokens(self) -> int | None:
        return self.reference.room_tokens()

    def host_bytes_needed(self, n_tokens: int) -> int:
        return 2 * self.reference.host_bytes_needed(n_tokens)  # the torch memory and its native copy

    def chunk_size(self) -> int:
        return self.reference.chunk_size()

    def max_context(self) -> int:
        return self.reference.max_context()

    def observations(self) -> dict[str, Any]:
        return self.reference.observations()
