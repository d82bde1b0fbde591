"""Fuzz target for our `sekv.*` GGUF metadata reader: a small GGUF with a baked router, damaged at the
byte level (flips, truncation, splices) or with arbitrary values in its `sekv.*` keys. Opening it and
reading the router either refuses with a SekvError (ModelError / RouterFileError) or returns a router
that satisfies every invariant (dims of this model, shapes from the dims, finite values). GGUF has no
checksum, so a flipped float inside an array is a different valid router; that is not a defect.
Fixed seed and bounded examples, so CI runs it the same way every time."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from byte_damage import apply_damage, damage

from sekv_local.errors import SekvError
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.sekv.router_file import gguf_entries, params_of

from test_router_file import TINY, perturbed_router

_MODEL_KEYS = {"block_count": 2, "embedding_length": 128, "feed_forward_length": 256, "attention.head_count": 2,
               "attention.head_count_kv": 1, "attention.key_length": 64, "context_length": 512, "vocab_size": 32}


def _write_gguf(path: Path, sekv_values: dict | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in _MODEL_KEYS.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value, kind in gguf_entries(params_of(perturbed_router(TINY), TINY, {"alpha": 1.0}, {"seed": 1})):
        value = (sekv_values or {}).get(key, value)
        if kind == "f32[]" and isinstance(value, list) and all(isinstance(v, float) for v in value):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_int64(key, value) if not 0 <= value < 2**32 else writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list) and value:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read(path: Path) -> None:
    try:
        params = GGUFModelFile(path).router_params()
    except SekvError:
        return  # refused with a message: fine
    if params is None:
        return  # the damage hit every sekv.* key name: the file simply has no router
    assert params.dims["n_layers"] == TINY.n_layers and params.dims["head_dim"] == TINY.head_dim
    for name, t in params.tensors.items():
        assert tuple(t.shape) == params.shape(name) and bool(torch.isfinite(t).all())


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "router.gguf"
    _write_gguf(path)
    assert GGUFModelFile(path).router_params() is not None  # the undamaged file is valid
    return path.read_bytes()


@seed(20261130)
@settings(database=None, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage())
def test_damaged_gguf_router_is_refused_or_valid(original: bytes, tmp_path: Path, change) -> None:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(apply_damage(original, change))
    _read(path)


def test_regression_a_string_value_that_is_not_utf8(original: bytes, tmp_path: Path) -> None:
    # found by the fuzzer: a flipped byte in a string value made the gguf package raise UnicodeDecodeError
    path = tmp_path / "damaged.gguf"
    path.write_bytes(apply_damage(original, ("flip", [(0, 1), (0, 1), (648, 128)])))
    with pytest.raises(SekvError, match="unreadable"):
        GGUFModelFile(path).router_params()


_values = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True, width=32), st.text(max_size=30), st.booleans(),
                    st.lists(st.floats(allow_nan=True, width=32), max_size=70),
                    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5))
_keys = st.sampled_from(["sekv.format_version", "sekv.n_layers", "sekv.n_heads", "sekv.n_kv_heads", "sekv.head_dim",
                         "sekv.routing_dim", "sekv.hparams", "sekv.info", "sekv.blk.0.q_proj",
                         "sekv.blk.1.threshold_logit", "sekv.blk.0.rank_energy_logit", "sekv.blk.1.k_proj"])


@seed(20261130)
@settings(database=None, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_keys, _values, min_size=1, max_size=3))
def test_arbitrary_sekv_values_are_refused_or_valid(tmp_path: Path, values: dict) -> None:
    path = tmp_path / "values.gguf"
    _write_gguf(path, values)
    _read(path)
