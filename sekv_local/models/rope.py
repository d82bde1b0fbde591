"""Rotary position embeddings in the two layouts GGUF models use."""

from __future__ import annotations

import torch

from .config import ModelConfig


class Rope:
    """Applies RoPE to pre-RoPE queries/keys at arbitrary positions.

    Keeping RoPE a separate step (rather than baked into cached keys) is what lets cache methods
    store keys before RoPE and choose positions when they rebuild them.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.dim = config.rope_dim
        self.interleaved = config.rope_interleaved
        self.scale = config.rope_scale
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim
        inv_freq = 1.0 / (config.rope_base ** exponent)  # [dim/2]
        if config.rope_freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
        self.inv_freq = inv_freq.to(torch.float32)

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
