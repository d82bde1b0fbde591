"""`quant`: every token kept, K and V stored block-quantized exactly as llama.cpp's q8_0 / q4_0.

Layout per layer (token-major, as llama.cpp's KV cache rows): keys and values of a token are one row of
n_kv_heads * head_dim values (post-RoPE keys), cut into blocks of 32 values (`quant_blocks`: ggml's
arithmetic, byte for byte). Attention dequantizes the whole cache (the current chunk included: it is stored
first, as llama.cpp does). The method compresses by a fixed ratio and takes no budget; like full KV it holds
at most the model's trained context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from ..quant_blocks import DEQUANTIZE, QK, QUANT_TYPES, QUANTIZE, to_ggml_bytes  # noqa: F401  (to_ggml_bytes: tests)
from .attention import CausalBias, gqa_attention
from .base import CachePolicy, register_policy


# -- the policy -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """type: block format of keys and values; k_type / v_type override it for one of them (like
    llama.cpp's --cache-type-k / --cache-type-v). grow_tokens: capacity step (the slack is counted)."""

    type: str = "q8_0"
    k_type: str | None = None
    v_type: str | None = None
    grow_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("type", "k_type", "v_type"):
            value = getattr(self, name)
            if (value is not None or name == "type") and value not in QUANT_TYPES:
                raise SekvError(f"quant: {name} must be one of {', '.join(QUANT_TYPES)}, got '{value}'")
        if not isinstance(self.grow_tokens, int) or self.grow_tokens < 1:
            raise SekvError("quant: grow_tokens must be an integer >= 1")

    @property
    def key_type(self) -> str:
        return self.k_type or self.type

    @property
    def value_type(self) -> str:
        return self.v_type or self.type


class QuantRows:
    """Quantized rows (token-major) grown in fixed steps: scales f16 [capacity, n/32] and quants
    [capacity, n] int8 (q8_0) or [capacity, n/2] uint8 (q4_0); the first `length` rows are valid."""

    def __init__(self, width: int, qtype: str, step: int, device: torch.device) -> None:
        self.qtype, self.width, self.step = qtype, width, step
        q_dtype, q_width = (torch.int8, width) if qtype == "q8_0" else (torch.uint8, width // 2)
        self.scales = torch.empty(0, width // QK, dtype=torch.float16, device=device)
        self.q = torch.empty(0, q_width, dtype=q_dtype, device=device)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        """rows [n, width] float."""
        scales, q = QUANTIZE[self.qtype](rows)
        need = self.length + rows.shape[0]
        if need > self.q.shape[0]:
            capacity = -(-need // self.step) * self.step
            for name in ("scales", "q"):
                old = getattr(self, name)
                new = torch.empty(capacity, old.shape[1], dtype=old.dtype, device=old.device)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.scales[self.length: need] = scales
        self.q[self.length: need] = q
        self.length = need

    def dequantized(self) -> torch.Tensor:
        return DEQUANTIZE[self.qtype](self.scales[: self.length], self.q[: self.length])

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def load(self, scales: torch.Tensor, q: torch.Tensor) -> None:
        if scales.shape[1:] != self.scales.shape[1:] or q.shape[1:] != self.q.shape[1:] or q.shape[0] != scales.shape[0]:
            raise ValueError(f"quantized rows of shapes {tuple(scales.shape)}/{tuple(q.shape)} do not fit this model")
        n = q.shape[0]
        capacity = -(-n // self.step) * self.step
        self.scales = torch.empty(capacity, self.scales.shape[1], dtype=torch.float16, device=self.q.device)
        self.q = torch.empty(capacity, self.q.shape[1], dtype=self.q.dtype, device=self.q.device)
        self.scales[:n] = scales.to(self.scales.device, torch.float16)
        self.q[:n] = q.to(self.q.device, self.q.dtype)
        self.length = n


class QuantCache(CachePolicy):
    name = "quant"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        if budget is not None:
            raise SekvError("quant: keeps every token at a fixed compression (q8_0: 34/64 of f16, q4_0: 18/64); "
                            "it takes no --budget")
        known = {"type", "k_type", "v_type", "grow_tokens"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise SekvError(f"quant: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        self.cfg = QuantConfig(**options)
        width = config.n_kv_heads * config.head_dim
        if width % QK:
            raise SekvError(f"quant: a token's K row has {width} values (kv_heads x head_dim), not a multiple of {QK}")
        self.keys = [QuantRows(width, self.cfg.key_type, self.cfg.grow_tokens, self.device)
                     for _ in range(config.n_layers)]
        self.values = [QuantRows(width, self.cfg.value_type, self.cfg.grow_tokens, self.device)
                       for _ in range(config.n_layers)]
        self._causal = CausalBias(self.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        KV, T, D = k.shape
        k_rot = self.rope.apply(k, self._positions, self._cos_sin)
        self.keys[layer].append(k_rot.transpose(0, 1).reshape(T, KV * D))
        self.values[layer].append(v.transpose(0, 1).reshape(T, KV * D))
        keys = self.keys[layer].dequantized().view(-1, KV, D).transpose(0, 1)
        values = self.values[layer].dequantized().view(-1, KV, D).transpose(0, 1)
        q_rot = self.rope.apply(q, self._positions, self._cos_sin)
        return gqa_attention(q_rot, keys, values, bias=self._causal(T, keys.shape[1]))

    def _checkpoint(self) -> tuple[int, int]:
        return (self.n_tokens, self.keys[0].length)

    def _restore(self, mark: tuple[int, int]) -> None:
        self.n_tokens = mark[0]
        for rows in self.keys + self.values:
            rows.truncate(mark[1])

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for tag, rows in (("k", k), ("v", v)):
                tensors[f"L{i}.{tag}_d"] = rows.scales[: rows.length]
                tensors[f"L{i}.{tag}_q"] = rows.q[: rows.length]
        meta = {"n_tokens": self.n_tokens, "length": self.keys[0].length,
                "k_type": self.cfg.key_type, "v_type": self.cfg.value_type}
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if (meta["k_type"], meta["v_type"]) != (self.cfg.key_type, self.cfg.value_type):
            raise ValueError(f"saved as {meta['k_type']}/{meta['v_type']}, this cache is "
                             f"{self.cfg.key_type}/{self.cfg.value_type}")
        length = int(meta["length"])
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for tag, rows in (("k", k), ("v", v)):
                rows.load(tensors[f"L{i}.{tag}_d"], tensors[f"L{i}.{tag}_q"])
                if rows.length != length:
                    raise ValueError(f"layer {i}: {rows.length} saved rows, expected {length}")
        self.n_tokens = int(meta["n_tokens"])

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        return [k.scales, k.q, v.scales, v.q]


@register_policy("quant")
def _make(**kwargs: Any) -> QuantCache:
    return QuantCache(**kwargs)


def _preset(qtype: str) -> Any:
    def make(**kwargs: Any) -> QuantCache:
        chosen = kwargs.pop("type", qtype)
        if chosen != qtype:
            raise SekvError(f"quant-{qtype}: the method name fixes type={qtype}; got type={chosen} "
                            f"(use --method quant with type=... instead)")
        return QuantCache(type=qtype, **kwargs)

    return make


for _qtype in QUANT_TYPES:
    register_policy(f"quant-{_qtype}")(_preset(_qtype))
