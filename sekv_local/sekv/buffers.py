"""Growable storage whose allocated size is what the memory report counts."""

from __future__ import annotations

import torch


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
