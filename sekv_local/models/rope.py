"""Rotary position embeddings in the two layouts GGUF models use."""

from __future__ import annotations

import torch

from .config import ModelConfig


class Rope:
    """Applies RoPE to pre-RoPE queries/keys at arbitrary positions.

    Keeping RoPE a separate step (rather than baked into cached keys) is what lets cache methods
    store keys before RoPE and choose positions when they rebuild them.

    Models with sliding-window layers (Gemma 3) rotate those with their own base and scale:
    `Rope(config)` is the global layers' RoPE and carries the local one in `.local`;
    `for_layer(i)` picks the right one (on other models `.local` is None and it is always self).
    """

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        self.dim = config.rope_dim
        self.interleaved = config.rope_interleaved
        self.config = config
        if local:
            base = config.rope_base_local if config.rope_base_local is not None else config.rope_base
            self.scale = config.rope_scale_local
        else:
            base, self.scale = config.rope_base, config.rope_scale
        self.base = base
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim
        inv_freq = 1.0 / (base ** exponent)  # [dim/2]
        if config.rope_freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
        self.inv_freq = inv_freq.to(torch.float32)
        self.local: Rope | None = Rope(config, local=True) if config.has_local_layers and not local else None

    def for_layer(self, layer: int) -> "Rope":
        """The RoPE of `layer`: the local one on sliding-window layers, else this one."""
        return self.local if self.local is not None and self.config.is_local(layer) else self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for `positions` [T] -> two tensors [T, dim/2] (float32)."""
        angles = (positions.to(torch.float64)[:, None] / self.scale) * self.inv_freq.to(torch.float64)[None, :]
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate x [..., T, head_dim] for positions [T]; returns a new tensor of the same shape."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions)
        cos = cos.to(x.device, x.dtype)
        sin = sin.to(x.device, x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        if self.interleaved:  # pairs (0,1), (2,3), ...
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:  # NeoX: pairs (i, i + dim/2)
            half = self.dim // 2
            a, b = rot[..., :half], rot[..., half:]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
