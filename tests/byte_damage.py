"""Byte-level damage for the fuzz targets: a hypothesis strategy and the function that applies it."""

from __future__ import annotations

from hypothesis import strategies as st


def damage(extra: st.SearchStrategy | None = None, max_flips: int = 8) -> st.SearchStrategy:
    """("flip", [(offset, xor mask)...]), ("truncate", n), ("insert", (offset, bytes)), plus `extra`
    (e.g. ("head", bytes) or ("prefix", bytes)); offsets wrap around the file's length."""
    kinds = [
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=max_flips)
        .map(lambda f: ("flip", f)),
        st.integers(0, 10**6).map(lambda n: ("truncate", n)),
        st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=64)).map(lambda x: ("insert", x)),
    ]
    return st.one_of(*kinds, *([extra] if extra is not None else []))


def apply_damage(original: bytes, change: tuple) -> bytes:
    """The damaged copy of `original`. "head" replaces the first 8 bytes (a length field), "prefix"
    puts bytes in front."""
    kind, arg = change
    data = bytearray(original)
    if kind == "flip":
        for offset, mask in arg:
            data[offset % len(data)] ^= mask
    elif kind == "truncate":
        data = data[: arg % len(data)]
    elif kind == "insert":
        offset, blob = arg
        data[offset % len(data): offset % len(data)] = blob
    elif kind == "head":
        data = bytearray(arg) + data[8:]
    elif kind == "prefix":
        data = bytearray(arg) + data
    else:
        raise ValueError(f"unknown damage {kind!r}")
    return bytes(data)
