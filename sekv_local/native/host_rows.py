"""The torch SeKV memory's spans kept as native host rows between native memories.

Each question's decode memory and each natively read prefill chunk is a new native memory; without this, each
one rebuilt every span's rows from the torch factors and copied the whole host tier (0.35 s of a 0.51 s import at
7,700 tokens on SmolLM2). Spans are append-only between rollbacks, so the rows of the spans made since the last
sync are the only ones rebuilt; a span's identity (SekvCache.span_ids) tells which held rows are still the
memory's after a rollback or a reset.
"""

from __future__ import annotations

import torch

from ..errors import SekvError
from ..sekv.policy import SekvCache
from .bindings import NativeHostRows, NativeModel
from .memory_export import decompressed_rows, rotator


class HostRowsMirror:
    """Native host rows that follow one engine's torch SeKV memory (every span as rotated raw rows, values
    transposed, span_rows = the memory's longest possible span)."""

    def __init__(self, model: NativeModel) -> None:
        self.model = model
        self.rows: NativeHostRows | None = None
        self._ids = torch.zeros(0, dtype=torch.long)  # [held]: the id of each span the rows hold
        self.rebuilt = 0  # spans the last sync rebuilt (the others were held already)

    def sync(self, sekv: SekvCache, model_layers: list[int]) -> NativeHostRows:
        """The rows, holding exactly `sekv`'s spans (model_layers: the model layer of each SeKV layer). Every native
        memory made on the rows before must be closed: moving or replacing rows makes them fail their next step."""
        if self.rows is None or self.rows.span_rows != sekv.l_max or self.rows.host_quant != sekv.cfg.host_quant:
            self.close()
            self.rows = NativeHostRows(self.model, sekv.l_max, sekv.cfg.host_quant)
            self._ids = torch.zeros(0, dtype=torch.long)
        ids = sekv.span_ids.view()
        S = int(ids.numel())
        if S != sekv.span_len.length:
            raise SekvError("native engine: the torch memory's span ids and spans disagree")
        shared = min(S, int(self._ids.numel()))
        differ = (ids[:shared] != self._ids[:shared]).nonzero()
        keep = int(differ[0]) if differ.numel() else shared
        self.rebuilt = S - keep
        if keep == S == int(self._ids.numel()):
            return self.rows
        lengths, starts = sekv.span_len.view().cpu(), sekv.span_pos.view().cpu()
        rotate = rotator(sekv)
        for layer, model_layer in zip(sekv.layers, model_layers):
            keys = decompressed_rows(layer.fac_k, lengths, starts, sekv.l_max, values=False, rotate=rotate, first=keep)
            values = decompressed_rows(layer.fac_v, lengths, starts, sekv.l_max, values=True, first=keep)
            self.rows.set(model_layer, keep, keys.raw, values.raw)
        self._ids = ids.clone()
        return self.rows

    def bytes(self) -> int:
        """Host bytes the rows hold (their whole buffer)."""
        return 0 if self.rows is None else self.rows.bytes()

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
            self.rows = None
        self._ids = torch.zeros(0, dtype=torch.long)
