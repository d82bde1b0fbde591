"""llama.cpp's q8_0 and q4_0 block formats in torch: quantize, dequantize, and ggml's byte layout.

Blocks of 32 values, each with an f16 scale `d` and 32 quants:

* q8_0: d = amax / 127, q = roundf(x / d) as int8 (34 bytes per 32 values);
* q4_0: d = m / -8 with m the value of largest magnitude (sign kept), q = min(15, trunc(x / d + 8.5))
  as 4 bits, packed two per byte: byte j of a block holds q[j] (low nibble) and q[j + 16] (high
  nibble); dequantized as (q - 8) * d (18 bytes per 32 values).

The arithmetic follows ggml's reference quantize_row_q8_0_ref / quantize_row_q4_0_ref (float32 scale and
inverse, roundf = half away from zero), so the bytes agree with `gguf.quants.quantize`.
"""

from __future__ import annotations

import torch

from .errors import SekvError

QK = 32  # values per block (QK8_0 == QK4_0 == 32)
QUANT_TYPES = ("q8_0", "q4_0")
#: storage bytes per block of 32 values (f16 scale + quants)
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2}


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf (half away from zero), written so float32 rounding cannot move a value across .5."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % QK:
        raise SekvError(f"quant: rows of {x.shape[-1]} values do not split into blocks of {QK}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % 32 == 0) -> (scales f16 [..., n/32], quants int8 [..., n])."""
    b = _blocks(x)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = _roundf(b * inv).to(torch.int8)
    return d.squeeze(-1).to(torch.float16), q.reshape(x.shape)


def dequantize_q8_0(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q8_0 -> float32 [..., n]."""
    b = q.reshape(*q.shape[:-1], q.shape[-1] // QK, QK).float() * scales.float()[..., None]
    return b.reshape(q.shape)


def quantize_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % 32 == 0) -> (scales f16 [..., n/32], packed uint8 [..., n/2])."""
    b = _blocks(x)
    idx = b.abs().argmax(dim=-1, keepdim=True)  # first of equal magnitudes, as C's strict '>' scan
    d = b.gather(-1, idx) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2:] << 4)
    return d.squeeze(-1).to(torch.float16), packed.reshape(*x.shape[:-1], x.shape[-1] // 2)


def dequantize_q4_0(scales: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q4_0 -> float32 [..., n]."""
    p = packed.reshape(*packed.shape[:-1], packed.shape[-1] // (QK // 2), QK // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).float() - 8
    b = q * scales.float()[..., None]
    return b.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
DEQUANTIZE = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0}


def to_ggml_bytes(scales: torch.Tensor, q: torch.Tensor, qtype: str) -> torch.Tensor:
    """Blocks as llama.cpp lays them out in memory (f16 d, then the quants): uint8 [..., n_blocks * block bytes]."""
    nb = scales.shape[-1]
    d = scales.contiguous().view(torch.uint8).reshape(*scales.shape[:-1], nb, 2)
    qs = q.contiguous().view(torch.uint8).reshape(*q.shape[:-1], nb, -1)
    return torch.cat([d, qs], dim=-1).reshape(*scales.shape[:-1], nb * BLOCK_BYTES[qtype])
