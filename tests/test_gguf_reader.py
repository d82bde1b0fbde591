"""The project's GGUF reader against the gguf package's: the same metadata and the same tensor bytes and values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from sekv_local.errors import ModelError
from sekv_local.models.gguf_file import GGUFModelFile, dequantized
from sekv_local.models.gguf_reader import GGUFContents, GGUFFormatError


def test_metadata_and_tensors_match_the_gguf_package(model_path) -> None:
    ours, theirs = GGUFModelFile(model_path), gguf.GGUFReader(str(model_path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the package's pseudo-keys of the header
    assert sorted(keys) == sorted(ours.keys())
    for key in keys:
        assert ours.metadata(key) == theirs.fields[key].contents(), key
    assert [t.name for t in theirs.tensors] == ours.tensor_names()
    for t in theirs.tensors[:12]:
        shape = tuple(int(d) for d in reversed(t.shape))
        reference = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        np.testing.assert_array_equal(ours.tensor(t.name).numpy(), reference)


def test_numpy_and_ggml_dequantize_alike(model_path) -> None:
    """The torch engine decodes weights with ggml where the native library is loaded, in numpy otherwise."""
    from sekv_local.native import bindings

    if not bindings.load_built_library():
        pytest.skip("the native library is not built")
    contents = GGUFContents(model_path)
    quantized = [t for t in contents.tensors.values() if t.type_id not in (0, 1, 30)][:6]
    assert quantized
    loaded, bindings._LIB = bindings._LIB, None
    try:
        in_numpy = [dequantized(t.data, t.type_id, tuple(reversed(t.dims))) for t in quantized]
    finally:
        bindings._LIB = loaded
    for t, expected in zip(quantized, in_numpy):
        np.testing.assert_array_equal(dequantized(t.data, t.type_id, tuple(reversed(t.dims))), expected)


def test_a_truncated_file_is_refused_with_a_reason(model_path, tmp_path) -> None:
    data = model_path.read_bytes()
    for cut in (20, 5000, len(data) // 2):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFContents(path)
        with pytest.raises(ModelError, match="cannot read GGUF file"):
            GGUFModelFile(path)
