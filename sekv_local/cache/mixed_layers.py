"""Any cache method on a model with sliding-window layers (Gemma 3: 5 local layers per global one).

Local layers keep their bounded window exactly (never compressed; llama.cpp's SWA cache does the
same) and count in the device tier; the method compresses the global layers, which it sees as a
model of its own (the same dims, `n_layers` = the global layers, no local ones).

A fractional budget f caps the device tier at the smaller of
  * f x the full-KV bytes of *all* layers (docs/DESIGN.md §4), and
  * the windows + f x the full-KV bytes of the global layers (what the method can compress).
The second bound matters: with 5 of 6 layers windowed, the SWA cache itself holds only about 17-21%
of docs/DESIGN.md §4's full-KV bytes at 16-32K tokens, so by the first bound alone a 25% budget would compress
nothing. A byte budget is the device limit as given. Either way the windows' bytes come off first
and the method gets the rest as an absolute budget.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BudgetError
from ..models.config import ModelConfig
from ..models.rope import Rope
from .attention import CausalBias, gqa_attention
from .base import CachePolicy, MemoryReport, PolicyFactory, storage_bytes
from .full import WindowKV



class MixedLayers(CachePolicy):
    """`inner` method on the global layers, exact sliding windows on the local ones."""

    supports_sliding_window = True

    def __init__(self, factory: PolicyFactory, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        self.global_layers = list(config.global_layers)
        self._inner_index = {layer: j for j, layer in enumerate(self.global_layers)}
        global_config = config.global_config()
        self.budget_spec = budget
        keep = config.sliding_window - 1
        # rows are dropped window/2 at a time (one copy per that many decode tokens) and prefill chunks are
        # at most a window long, so a window never holds more than 2.5 windows of rows
        self.step = max(1, config.sliding_window // 2)
        self.windows = {i: WindowKV(config.n_kv_heads, config.head_dim, torch.float16, self.step, self.device, keep)
                        for i in range(config.n_layers) if config.is_local(i)}
        # the method plans from the start with its share (the windows at their largest chunk come off first)
        share = self._inner_budget(config.context_length, chunk=config.sliding_window)
        self.inner = factory(config=global_config, rope=Rope(global_config), device=device, budget=share, **options)
        self.name = self.inner.name
        self.needs_token_scores = self.inner.needs_token_scores
        self._causal_local = CausalBias(self.device, window=config.sliding_window)
        self._window_peak = 0
        self.reserve(config.context_length)

    # -- budget ------------------------------------------------------------------------------------
    def window_bytes(self, chunk: int | None = None) -> int:
        """Most bytes the local layers' windows hold at once (rows kept + eviction slack + one chunk)."""
        c = self.config
        rows = c.sliding_window - 1 + self.step + (self.max_chunk_tokens() if chunk is None else chunk)
        return len(self.windows) * 2 * c.n_kv_heads * c.head_dim * 2 * rows

    def _inner_budget(self, n_tokens: int, chunk: int | None = None) -> int | None:
        """The method's share of the budget for about n_tokens: what the windows leave (None: no budget)."""
        if self.budget_spec is None:
            return None
        n = max(int(n_tokens), 1)
        whole = self.config.full_kv_bytes(n)
        windows = self.window_bytes(chunk)
        if isinstance(self.budget_spec, float):
            compressible = len(self.global_layers) * whole // self.config.n_layers
            total = min(int(self.budget_spec * whole), windows + int(self.budget_spec * compressible))
        else:
            total = int(self.budget_spec)
        if total <= windows:
            raise BudgetError(
                f"a budget of {total / 2**20:.2f} MiB does not even hold the sliding windows of the "
                f"{len(self.windows)} local layers ({windows / 2**20:.2f} MiB, never compressed). "
                f"Use at least --budget {min(1.0, 1.5 * windows / whole):.2f}.")
        return total - windows

    def reserve(self, n_tokens: int) -> None:
        left = self._inner_budget(n_tokens)
        if left is not None:
            self.inner.budget_spec = left
        self.inner.reserve(n_tokens)

    def max_chunk_tokens(self) -> int | None:
        inner = self.inner.max_chunk_tokens()
        return min(inner, self.config.sliding_window) if inner else self.config.sliding_window

    def max_tokens(self) -> int | None:
        return self.inner.max_tokens()

    def room_tokens(self) -> int | None:
        return self.inner.room_tokens()

    def host_bytes_needed(self, n_tokens: int) -> int:
        return self.inner.host_bytes_needed(n_tokens)

    # -- the engine's calls ------------------------------------------------------------------------
    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        super().begin_chunk(positions, is_prefill)
        self.inner.begin_chunk(positions, is_prefill)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = self.windows.get(layer)
        if store is None:
            return self.inner.attend(self._inner_index[layer], q, k, v)
        rope, cos_sin = self.layer_rope(layer)
        store.append(rope.apply(k, self._positions, cos_sin), v)
        keys, values = store.keys(), store.values()
        out = gqa_attention(rope.apply(q, self._positions, cos_sin), keys, values,
                            bias=self._causal_local(q.shape[1], keys.shape[1]))
        self._window_peak = max(self._window_peak, self._windows_now())
        store.evict()
        return out

    def add_window_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A chunk's rows of a local layer computed elsewhere (the native engine's prefill): k post-RoPE, v
        [KV, T, D], appended as `attend` appends its own."""
        store = self.windows[layer]
        store.append(k, v)
        self._window_peak = max(self._window_peak, self._windows_now())
        store.evict()

    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        self.inner.end_chunk(logits, token_ids)
        self.n_tokens = self.inner.n_tokens

    def score_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        return self.inner.score_rows(token_ids)

    def finish_prefill(self) -> None:
        self.inner.finish_prefill()

    def reset_observations(self) -> None:
        self.inner.reset_observations()

    def observations(self) -> dict[str, Any]:
        """The method's observations; layer numbers in them count the global layers only."""
        return self.inner.observations()

    # -- rollback and persistence -----------------------------------------------------------------
    def _checkpoint(self) -> Any:
        return self.inner.mark(), {i: w.snapshot() for i, w in self.windows.items()}

    def _restore(self, mark: Any) -> None:
        inner, windows = mark
        self.inner.rollback(inner)
        for i, snapshot in windows.items():
            self.windows[i].restore(snapshot)
        self.n_tokens = self.inner.n_tokens

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = self.inner.export_state()
        out = {f"inner.{k}": v for k, v in tensors.items()}
        for i, w in self.windows.items():
            out[f"W{i}.k"], out[f"W{i}.v"] = w.keys(), w.values()
        local = next(iter(self.windows.values()))
        return out, {"inner": meta, "window_start": local.start}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.inner.import_state({k[len("inner."):]: v for k, v in tensors.items() if k.startswith("inner.")},
                                meta["inner"])
        c = self.config
        for i, w in self.windows.items():
            k, v = tensors[f"W{i}.k"], tensors[f"W{i}.v"]
            if k.dim() != 3 or k.shape[0] != c.n_kv_heads or k.shape[2] != c.head_dim or v.shape != k.shape \
                    or k.shape[1] > c.sliding_window - 1 + self.step:
                raise ValueError(f"layer {i}: window rows of shape {tuple(k.shape)} do not fit the model")
            w.restore((int(meta["window_start"]), k, v))
        self.n_tokens = self.inner.n_tokens

    # -- accounting --------------------------------------------------------------------------------
    def _windows_now(self) -> int:
        return sum(storage_bytes(w.k, w.v) for w in self.windows.values())

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        w = self.windows.get(layer)
        return [w.k, w.v] if w is not None else self.inner.device_tensors(self._inner_index[layer])

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        return [] if layer in self.windows else self.inner.host_tensors(self._inner_index[layer])

    def memory(self) -> MemoryReport:
        """The method's report over the global layers plus the windows, per layer in model order;
        the peak adds the method's peak and the windows' (both are held at the same time)."""
        inner = self.inner.memory()
        dev = [storage_bytes(*self.device_tensors(i)) if i in self.windows else
               inner.device_per_layer[self._inner_index[i]] for i in range(self.config.n_layers)]
        host = [0 if i in self.windows else inner.host_per_layer[self._inner_index[i]]
                for i in range(self.config.n_layers)]
        windows = self._windows_now()
        return MemoryReport(tokens=self.n_tokens, device_bytes=sum(dev),
                            device_peak_bytes=inner.device_peak_bytes + max(self._window_peak, windows),
                            host_bytes=sum(host), full_kv_bytes=self.config.full_kv_bytes(self.n_tokens),
                            device_per_layer=dev, host_per_layer=host, host_reads=inner.host_reads,
                            full_kv_held_bytes=self.config.full_kv_held_bytes(self.n_tokens),
                            checkpoint_bytes=inner.checkpoint_bytes + self.checkpoint_bytes())
