"""A GGUF file's metadata and tensor table, read in well under a second.

The gguf package's reader builds a numpy view for every element of every metadata array: on Gemma 3's 262K-token
vocabulary (three arrays of 262K entries) that took 17 s of a command's start. Here numeric arrays are one
`np.frombuffer` each and string arrays are decoded only when asked for; tensor data stays memory-mapped.
Layout (GGUF v2/v3): header, key/value pairs, tensor infos, then the aligned data section.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (truncated, damaged or an unknown version)."""


@dataclass(frozen=True)
class RawString:
    """A metadata string value, decoded on demand (a damaged one fails where it is read, not at open)."""

    data: bytes

    def decode(self) -> str:
        return self.data.decode("utf-8")


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, decoded on demand: `count` strings starting at byte `offset`."""

    buffer: Any
    offset: int
    count: int

    def decode(self) -> list[str]:
        out, at = [], self.offset
        for _ in range(self.count):
            n = struct.unpack_from("<Q", self.buffer, at)[0]
            out.append(bytes(self.buffer[at + 8: at + 8 + n]).decode("utf-8"))
            at += 8 + n
        return out

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its ggml type id, dims fastest-first (as GGUF lists them) and its bytes (a read-only view)."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    data: np.ndarray


class GGUFContents:
    """Metadata (`fields`: key -> int, float, bool, RawString, numpy array or StringArray) and tensors of a GGUF
    file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise GGUFFormatError(f"truncated or damaged ({exc.__class__.__name__}: {exc})") from None

    def _parse(self) -> None:
        buf = self._buf
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFFormatError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        at = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, at = self._string(at)
            (kind,), at = struct.unpack_from("<I", buf, at), at + 4
            self.fields[key], at = self._value(kind, at)
        infos = []
        for _ in range(n_tensors):
            name, at = self._string(at)
            (n_dims,), at = struct.unpack_from("<I", buf, at), at + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at)
            at += 8 * n_dims
            type_id, offset = struct.unpack_from("<IQ", buf, at)
            at += 12
            infos.append((name, type_id, tuple(int(d) for d in dims), offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, type_id, dims, offset in infos:
            size = tensor_bytes(type_id, dims)
            first = start + offset
            if first + size > len(self._map):
                raise GGUFFormatError(f"tensor '{name}' runs past the end of the file")
            self.tensors[name] = TensorInfo(name, type_id, dims, self._map[first: first + size])

    def _string(self, at: int) -> tuple[str, int]:
        raw, end = self._raw_string(at)
        return raw.decode(), end

    def _raw_string(self, at: int) -> tuple[RawString, int]:
        (n,) = struct.unpack_from("<Q", self._buf, at)
        end = at + 8 + n
        if end > len(self._buf):
            raise GGUFFormatError("a string runs past the end of the file")
        return RawString(bytes(self._buf[at + 8: end])), end

    def _value(self, kind: int, at: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt = _SCALARS[kind][0]
            return struct.unpack_from(fmt, self._buf, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return self._raw_string(at)
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buf, at)
        at += 12
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = at + count * dtype.itemsize
            if end > len(self._buf):
                raise GGUFFormatError("an array runs past the end of the file")
            return np.frombuffer(self._map, dtype=dtype, count=count, offset=at), end
        if item == _STRING:
            first = at
            for _ in range(count):  # only the lengths are read here
                at += 8 + struct.unpack_from("<Q", self._buf, at)[0]
            if at > len(self._buf):
                raise GGUFFormatError("a string array runs past the end of the file")
            return StringArray(self._buf, first, count), at
        values = []
        for _ in range(count):  # arrays of arrays: rare, read as nested lists
            value, at = self._value(item, at)
            values.append(value)
        return values, at


def tensor_bytes(type_id: int, dims: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type `type_id` with `dims` elements (fastest dim first, whole blocks)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown tensor type {type_id}") from None
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFFormatError(f"a row of {dims[0]} values is not whole blocks of {block}")
    return n // block * size


def plain_value(value: Any) -> Any:
    """A metadata value as the gguf package's `contents()` gives it: arrays as lists."""
    if isinstance(value, (StringArray, RawString)):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    return value
