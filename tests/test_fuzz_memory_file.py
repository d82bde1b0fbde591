"""Fuzz target for the saved-memory parser: any byte-level damage to a real memory file (flips,
truncation, splices, a rewritten header) is either refused with MemoryFileError or, when the damage
happens to be harmless, loads the original contents — never another exception, never wrong data.
Fixed seed and a bounded number of examples, so CI runs it the same way every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from byte_damage import apply_damage, damage

from sekv_local.persistence import MemoryFileError, load_memory, read_header, save_memory

TENSORS = {"L0.k": torch.arange(96, dtype=torch.float16).view(2, 3, 16), "span_len": torch.tensor([3, 5, 8])}
HEADER = {"model": {"name": "fuzz", "sha256": "0" * 64}, "method": "sekv", "document": {"sha256": "1" * 64}}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "memory.sekv"
    save_memory(path, TENSORS, HEADER)
    return path.read_bytes()


def _load(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "damaged.sekv"
    path.write_bytes(data)
    try:
        read_header(path)
        tensors, header = load_memory(path)
    except MemoryFileError:
        return  # refused with a clear message: fine
    assert {k: v.tolist() for k, v in tensors.items()} == {k: v.tolist() for k, v in TENSORS.items()}
    assert header["method"] == "sekv"


DAMAGE = damage(st.binary(max_size=64).map(lambda b: ("head", b)))


@seed(20261129)
@settings(database=None, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(DAMAGE)
def test_damaged_memory_files_are_refused_or_harmless(original: bytes, tmp_path: Path, change) -> None:
    _load(apply_damage(original, change), tmp_path)


@seed(20261129)
@settings(database=None, max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20))
def test_any_json_in_the_header_slot_is_refused_or_loads(original: bytes, tmp_path: Path, value) -> None:
    # a well-formed safetensors file whose JSON header (and our metadata inside it) is arbitrary
    size = int.from_bytes(original[:8], "little")
    header = json.loads(original[8: 8 + size])
    header["__metadata__"] = {"sekv_local": json.dumps(value)} if not isinstance(value, dict) else value
    blob = json.dumps(header).encode()
    _load(len(blob).to_bytes(8, "little") + blob + original[8 + size:], tmp_path)


@pytest.mark.parametrize("metadata", [None, [], {"sekv_local": None}, {"sekv_local": 5}, {"sekv_local": "[1, 2]"}])
def test_regression_headers_that_are_not_objects(original: bytes, tmp_path: Path, metadata) -> None:
    # found by the fuzzer: a JSON null header crashed read_header with AttributeError
    size = int.from_bytes(original[:8], "little")
    header = json.loads(original[8: 8 + size])
    header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    path = tmp_path / "m.sekv"
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + original[8 + size:])
    with pytest.raises(MemoryFileError, match="not a sekv-local memory file"):
        read_header(path)
