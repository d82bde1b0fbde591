"""Growable storage whose allocated size is what the memory report counts."""

from __future__ import annotations

import torch

from ..quant_blocks import BLOCK_BYTES, DEQUANTIZE, QK, QUANTIZE, to_ggml_bytes


class FlatBuffer:
    """A 1-D tensor grown by 25% steps (its slack is counted as host memory); `data[:length]` is valid."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.data = torch.empty(0, dtype=dtype, device=device)
        self.length = 0

    def append(self, values: torch.Tensor) -> int:
        """Append a 1-D tensor; returns the offset where it starts."""
        offset, n = self.length, int(values.numel())
        if offset + n > self.data.numel():
            capacity = max(offset + n, self.data.numel() + self.data.numel() // 4, 1024)  # 1.25x: slack is counted
            new = torch.empty(capacity, dtype=self.data.dtype, device=self.data.device, pin_memory=self.pin)
            new[:offset] = self.data[:offset]
            self.data = new
        self.data[offset: offset + n] = values.reshape(-1).to(self.data.dtype)
        self.length = offset + n
        return offset

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def valid(self) -> torch.Tensor:
        return self.data[: self.length]

    def load(self, values: torch.Tensor) -> None:
        """Replace the contents (a saved memory)."""
        self.length = 0
        self.append(values)

    @property
    def value_bytes(self) -> float:
        """Bytes one stored value takes."""
        return float(self.data.element_size())

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Values at flat indexes (any shape, each < length), as stored."""
        return self.data[index]

    def rows(self, row: torch.Tensor, width: int) -> torch.Tensor:
        """Whole rows [..., width] of the buffer read as [-1, width] rows (row index < length // width)."""
        return self.data[: self.length - self.length % width].view(-1, width)[row]

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def state(self) -> dict[str, torch.Tensor]:
        """What a saved memory keeps (suffix -> tensor)."""
        return {"": self.valid()}

    def load_state(self, parts: dict[str, torch.Tensor]) -> None:
        if set(parts) != {""}:
            raise ValueError("a block-quantized host tier cannot be read into an unquantized one (host_quant)")
        self.load(parts[""])


class QuantFlatBuffer:
    """FlatBuffer's interface over llama.cpp's q8_0 / q4_0 blocks, stored as ggml lays them out: uint8
    [capacity / 32, block bytes], each block its f16 scale then its quants (32 int8, or 16 bytes of two 4-bit
    quants), so the bytes are what a ggml tensor of that type holds. Each append starts at a multiple of
    `align` (a multiple of 32: whole blocks, so a truncation never cuts a block another append must fill) and is
    zero padded to a whole block; reads dequantize only what they gather."""

    def __init__(self, qtype: str, align: int = QK, pin: bool = False) -> None:
        if qtype not in QUANTIZE:
            raise ValueError(f"unknown block format {qtype!r}")
        if align % QK:
            raise ValueError(f"blocks of {QK} values need an alignment that is a multiple of {QK}, not {align}")
        self.qtype, self.align = qtype, align
        self.pin = pin and torch.cuda.is_available()
        self.packed = qtype == "q4_0"  # two quants per byte
        self.blocks = torch.empty(0, BLOCK_BYTES[qtype], dtype=torch.uint8)
        self.length = 0

    @property
    def value_bytes(self) -> float:
        return BLOCK_BYTES[self.qtype] / QK

    def _grow(self, values: int) -> None:
        need = values // QK
        have = self.blocks.shape[0]
        if need <= have:
            return
        capacity = max(need, have + have // 4, 32)  # 1.25x: slack is counted
        new = torch.empty(capacity, self.blocks.shape[1], dtype=torch.uint8, pin_memory=self.pin)
        new[:have] = self.blocks
        self.blocks = new

    def append(self, values: torch.Tensor) -> int:
        """Append a 1-D tensor (quantized here); returns the offset where it starts."""
        offset = -(-self.length // self.align) * self.align
        n = int(values.numel())
        if n == 0:
            return offset
        padded = -(-n // QK) * QK
        self._grow(offset + padded)
        flat = torch.zeros(padded)
        flat[:n] = values.reshape(-1).float()
        scales, q = QUANTIZE[self.qtype](flat.view(-1, QK))
        b0 = offset // QK
        self.blocks[-(-self.length // QK): b0] = 0  # the alignment gap: zeros, not whatever the allocation held
        self.blocks[b0: b0 + padded // QK] = to_ggml_bytes(scales, q, self.qtype)
        self.length = offset + n
        return offset

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @staticmethod
    def _scales(blocks: torch.Tensor) -> torch.Tensor:
        """blocks uint8 [..., block bytes] -> their scales f16 [...]."""
        return blocks[..., :2].contiguous().view(torch.float16)[..., 0]

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Values at flat indexes (any shape, each < length), dequantized -> float32."""
        block, j = index // QK, index % QK
        d = self._scales(self.blocks[block]).float()
        if not self.packed:
            return self.blocks[block, 2 + j].view(torch.int8).float() * d
        byte = self.blocks[block, 2 + j % (QK // 2)]
        nibble = torch.where(j < QK // 2, byte & 0x0F, byte >> 4)
        return (nibble.float() - 8) * d

    def rows(self, row: torch.Tensor, width: int) -> torch.Tensor:
        """Whole rows -> float32 [..., width]; width must be a multiple of 32 and of every row's start."""
        per_row = width // QK
        n_rows = self.length // width
        blocks = self.blocks[: n_rows * per_row].view(n_rows, per_row, -1)[row]  # [..., per_row, block bytes]
        quants = blocks[..., 2:].reshape(*blocks.shape[:-2], -1)
        return DEQUANTIZE[self.qtype](self._scales(blocks), quants.view(torch.int8) if not self.packed else quants)

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]

    def state(self) -> dict[str, torch.Tensor]:
        return {f".{self.qtype}.blocks": self.blocks[: -(-self.length // QK)],
                f".{self.qtype}.n": torch.tensor([self.length])}

    def load_state(self, parts: dict[str, torch.Tensor]) -> None:
        tag = f".{self.qtype}"
        if set(parts) != {f"{tag}.blocks", f"{tag}.n"}:
            raise ValueError(f"this host tier is stored as {self.qtype}; the saved one is not (host_quant)")
        length = int(parts[f"{tag}.n"][0])
        blocks = parts[f"{tag}.blocks"]
        if blocks.dim() != 2 or blocks.shape != (-(-length // QK), BLOCK_BYTES[self.qtype]):
            raise ValueError("block-quantized host tier: blocks and length disagree")
        self.length = 0
        self._grow(blocks.shape[0] * QK)
        self.blocks[: blocks.shape[0]] = blocks.to(torch.uint8)
        self.length = length


class RowBuffer:
    """Rows along dim 1 of a [heads, capacity, width] tensor, grown in steps; `view()` is valid."""

    def __init__(self, heads: int, width: int, dtype: torch.dtype, device: torch.device | str, step: int = 256) -> None:
        self.data = torch.empty(heads, 0, width, dtype=dtype, device=device)
        self.length = 0
        self.step = step

    def append(self, rows: torch.Tensor) -> None:
        """rows [heads, n, width]."""
        n = rows.shape[1]
        need = self.length + n
        if need > self.data.shape[1]:
            capacity = -(-need // self.step) * self.step
            new = torch.empty(self.data.shape[0], capacity, self.data.shape[2], dtype=self.data.dtype,
                              device=self.data.device)
            new[:, : self.length] = self.data[:, : self.length]
            self.data = new
        self.data[:, self.length: need] = rows.to(self.data.dtype)
        self.length = need

    def growth_bytes(self, n: int) -> int:
        """Bytes the allocation grows by when n more rows arrive (it grows in whole steps)."""
        need = self.length + n
        if need <= self.data.shape[1]:
            return 0
        rows = -(-need // self.step) * self.step - self.data.shape[1]
        return rows * self.data.shape[0] * self.data.shape[2] * self.data.element_size()

    def drop_front(self, n: int) -> None:
        """Remove the first n rows (shift the rest down; capacity is kept)."""
        if n <= 0:
            return
        rest = self.length - n
        self.data[:, :rest] = self.data[:, n: self.length].clone()
        self.length = rest

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def shrink(self) -> None:
        """Give back capacity beyond the next growth step (after a burst such as a prefill chunk)."""
        capacity = -(-self.length // self.step) * self.step
        if capacity < self.data.shape[1]:
            self.data = self.data[:, :capacity].clone()

    def view(self) -> torch.Tensor:
        return self.data[:, : self.length]

    def load(self, rows: torch.Tensor) -> None:
        """Replace the contents (a saved memory); rows [heads, n, width]."""
        if rows.dim() != 3 or rows.shape[0] != self.data.shape[0] or rows.shape[2] != self.data.shape[2]:
            raise ValueError(f"rows of shape {tuple(rows.shape)} do not fit [{self.data.shape[0]}, n, {self.data.shape[2]}]")
        self.length = 0
        self.append(rows)


class VecBuffer(RowBuffer):
    """A growable 1-D vector (positions, span metadata) on top of RowBuffer."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str, step: int = 256) -> None:
        super().__init__(1, 1, dtype, device, step)

    def append(self, values: torch.Tensor) -> None:  # type: ignore[override]
        super().append(values.reshape(1, -1, 1))

    def view(self) -> torch.Tensor:  # type: ignore[override]
        return self.data[0, : self.length, 0]

    def load(self, values: torch.Tensor) -> None:  # type: ignore[override]
        if values.dim() != 1:
            raise ValueError(f"expected a vector, got shape {tuple(values.shape)}")
        self.length = 0
        self.append(values)
