"""GGUF tensor types through GGUFModelFile: real files, real quantizers.

1. Small synthetic GGUFs (gguf.GGUFWriter + gguf.quants.quantize) for every type gguf-py can
   quantize: torch-order shapes and values within each type's quantization error.
2. K-quants (Q4_K, Q6_K), which gguf-py can only dequantize: the default model requantized to
   Q4_K_M by llama.cpp's own quantizer, loaded tensor by tensor and run through the torch engine.
3. Bad files and bad requests raise ModelError with a clear message.
"""

from __future__ import annotations

import collections
import ctypes
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from sekv_local.errors import ModelError  # noqa: E402
from sekv_local.models.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFModelFile, tensor_type_name  # noqa: E402

BLOCK = 32  # block size of every legacy type below


# ------------------------------------------------------------------------------------ helpers

def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QT]]) -> Path:
    """A minimal GGUF holding `tensors` (name -> (float32 torch-order values, GGUF type))."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for name, (values, qtype) in tensors.items():
        if qtype == QT.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == QT.I32:
            writer.add_tensor(name, values.astype(np.int32))
        else:  # byte rows; the writer turns the byte shape back into the element shape
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _blocks(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, BLOCK).astype(np.float64)


def error_bound(x: np.ndarray, qtype: QT) -> np.ndarray:
    """Per-element bound on |dequant(quant(x)) - x|, derived from each type's scheme (scales stored
    as f16, hence the small relative extras)."""
    if qtype == QT.F32:
        return np.zeros(x.shape)
    if qtype == QT.F16:  # round to nearest: half an ulp, 2**-11 relative
        return np.abs(x.astype(np.float64)) * 2.0 ** -11 + 1e-7
    if qtype == QT.BF16:  # 8-bit significand, round to nearest even
        return np.abs(x.astype(np.float64)) * 2.0 ** -8 + 1e-7
    b = _blocks(x)
    amax = np.abs(b).max(axis=1, keepdims=True)
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    if qtype == QT.Q8_0:  # d = amax/127, half a step, plus up to 127 steps of f16 error in d
        step = amax / 127
        bound = step * (0.5 + 127 * 2.0 ** -11) * 1.01
    elif qtype in (QT.Q4_0, QT.Q5_0):  # d = signed max / -2^(bits-1); the far side clips: a full step
        levels = 8 if qtype == QT.Q4_0 else 16
        step = amax / levels
        bound = step * (1 + 2 * levels * 2.0 ** -11) * 1.01
    elif qtype in (QT.Q4_1, QT.Q5_1):  # d = (max-min)/(2^bits-1), half a step, f16 d and min
        levels = 15 if qtype == QT.Q4_1 else 31
        step = (hi - lo) / levels
        bound = (step * (0.5 + levels * 2.0 ** -11) + np.abs(lo) * 2.0 ** -11) * 1.01
    else:
        raise AssertionError(qtype)
    return np.broadcast_to(bound + 1e-7, b.shape).reshape(x.shape)


SYNTHETIC_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]


# ------------------------------------------------------------------ 1. synthetic, gguf-py quantized

@pytest.mark.parametrize("qtype", SYNTHETIC_TYPES, ids=lambda t: t.name)
def test_synthetic_types_round_trip(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    originals = {
        # non-square so a transposed read cannot pass; GGUF dims are [cols, rows]
        "w2d": (rng.standard_normal((8, 96)) * 0.05).astype(np.float32),
        "w3d": (rng.standard_normal((2, 3, 64)) * 2.0).astype(np.float32),
        # rows of very different magnitudes, with an outlier, and an all-zero block
        "wmix": np.concatenate([rng.standard_normal((3, 64)) * s for s in (1e-3, 1.0, 30.0)]).astype(np.float32),
    }
    originals["wmix"][1, 5] = 12.0
    originals["wmix"][0, :32] = 0.0
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", {n: (v, qtype) for n, v in originals.items()})

    # the file holds what we meant to write: the type and GGUF's fastest-first dims
    reader = gguf.GGUFReader(str(path))
    info = {t.name: t for t in reader.tensors}
    assert info["w2d"].tensor_type == qtype
    assert [int(d) for d in info["w2d"].shape] == [96, 8]
    assert [int(d) for d in info["w3d"].shape] == [64, 3, 2]

    f = GGUFModelFile(path)
    assert set(f.tensor_names()) == set(originals)
    for name, x in originals.items():
        got = f.tensor(name, expected_shape=x.shape)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert tuple(got.shape) == x.shape  # torch order: [rows, cols]
        got = got.numpy().astype(np.float64)
        err = np.abs(got - x.astype(np.float64))
        bound = error_bound(x, qtype)
        worst = float((err / np.maximum(bound, 1e-30)).max()) if qtype != QT.F32 else 0.0
        assert np.all(err <= bound), f"{qtype.name} {name}: error {err.max():.3g} over bound (worst ratio {worst:.2f})"
        if qtype == QT.F32:
            assert np.array_equal(got, x), "F32 must be exact"
        else:  # really rounded (not silently stored as f32), and an all-zero block stays exactly zero
            assert err.max() > 0
            assert np.all(got[x == 0] == 0)
        # the tensor is an owned, writable copy (torch would warn on a read-only memmap)
        got_t = f.tensor(name)
        got_t += 1.0
        assert torch.equal(f.tensor(name), torch.from_numpy(got.astype(np.float32)))


def test_quantization_error_is_type_ordered(tmp_path):
    """Sanity of the bounds above: more bits -> smaller measured error on the same data."""
    x = np.random.default_rng(7).standard_normal((16, 256)).astype(np.float32)
    path = write_gguf(tmp_path / "all.gguf", {t.name: (x, t) for t in SYNTHETIC_TYPES})
    f = GGUFModelFile(path)
    rms = {t.name: float(np.sqrt(np.mean((f.tensor(t.name).numpy() - x) ** 2))) for t in SYNTHETIC_TYPES}
    print("\nsynthetic RMS error (unit normal data):", {k: f"{v:.2e}" for k, v in rms.items()})
    assert rms["F32"] == 0.0
    assert rms["F16"] < rms["BF16"] < rms["Q8_0"] < rms["Q5_1"] < rms["Q4_1"]
    assert rms["Q8_0"] < rms["Q5_0"] < rms["Q4_0"]


# ------------------------------------------------------------- 2. K-quants via llama.cpp's quantizer

def natural_tokens(tokenizer, n: int = 256) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in ("assignment", "if", "while", "for", "try", "with"))
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    ids = ids[:n]
    return [tokenizer.bos_id, *ids] if tokenizer.add_bos else ids


@pytest.fixture(scope="module")
def kquant_path(model_path, tmp_path_factory) -> Path:
    """The default model requantized to Q4_K_M by llama.cpp (its own K-quant code)."""
    import llama_cpp

    from sekv_local.models.tokenizer import _quiet_stderr

    dst = tmp_path_factory.mktemp("kquant") / "model.Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    params.nthread = 2
    start = time.perf_counter()
    with _quiet_stderr():
        rc = llama_cpp.llama_model_quantize(str(model_path).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    print(f"\nrequantized {Path(model_path).name} -> Q4_K_M in {time.perf_counter() - start:.1f}s")
    return dst


def test_kquant_file_has_q4_k_and_q6_k(kquant_path):
    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(kquant_path)).tensors)
    print("\nQ4_K_M tensor types:", dict(types))
    # Q4_K_M: Q4_K for most rows of length 256k, Q6_K for some ffn_down; the n_embd=576 rows fall
    # back to legacy types. Every type present must be one the torch engine supports.
    assert types["Q4_K"] > 0 and types["Q6_K"] > 0
    assert set(types) <= SUPPORTED_TENSOR_TYPES, set(types) - SUPPORTED_TENSOR_TYPES


def test_kquant_tensors_match_original(kquant_path, model_path):
    """Every tensor loads, keeps its torch shape and stays close to the Q4_1 original's values."""
    src, kq = GGUFModelFile(model_path), GGUFModelFile(kquant_path)
    assert set(kq.tensor_names()) == set(src.tensor_names())
    infos = {name: tensor_type_name(t.type_id) for name, t in kq._tensors.items()}
    worst: dict[str, float] = {}
    for name in kq.tensor_names():
        a = src.tensor(name)
        b = kq.tensor(name, expected_shape=tuple(a.shape))
        assert torch.isfinite(b).all(), name
        rel = float((b - a).norm() / a.norm().clamp_min(1e-12))
        worst[infos[name]] = max(worst.get(infos[name], 0.0), rel)
    print("\nworst relative L2 error vs the Q4_1 original, per type:", {k: f"{v:.3f}" for k, v in worst.items()})
    assert worst["F32"] == 0.0
    assert worst["Q6_K"] < 0.1   # measured ~0.02
    assert worst["Q4_K"] < 0.1   # measured ~0.02; a wrong layout/scale decode gives ~1 or more


@pytest.mark.slow  # ~35 s on 2 busy cores: two full model loads and two 256-token forward passes
def test_kquant_model_scores_natural_text(kquant_path, model_path, tokenizer):
    from sekv_local.engines.base import EngineOptions
    from sekv_local.engines.torch_engine import TorchEngine

    tokens = natural_tokens(tokenizer)
    opts = EngineOptions(method="full", device="cpu", chunk_size=1024)
    results = {}
    for label, path in (("Q4_1", model_path), ("Q4_K_M", kquant_path)):
        start = time.perf_counter()
        engine = TorchEngine(path, tokenizer, opts)
        lp, am = engine.score(tokens)
        results[label] = (lp, am)
        print(f"\n{label}: mean log-prob {lp.mean():.4f} over {len(lp)} tokens, "
              f"top-1 {np.mean(am == np.array(tokens[1:])):.3f} ({time.perf_counter() - start:.1f}s)")
    (lp0, am0), (lp1, am1) = results["Q4_1"], results["Q4_K_M"]
    delta = abs(float(lp1.mean() - lp0.mean()))
    agree = float(np.mean(am0 == am1))
    print(f"Q4_K_M vs Q4_1: |delta mean log-prob| {delta:.4f} nats, argmax agreement {agree:.3f}")
    assert np.isfinite(lp1).all()
    assert lp0.mean() > -4.0  # the original model reads Python docs sensibly
    assert delta < 0.3
    assert agree >= 0.8


# ------------------------------------------------------------------------------ 3. error cases

def test_truncated_file_raises_model_error(model_path, tmp_path):
    data = Path(model_path).read_bytes()
    for label, blob in (("half", data[: len(data) // 2]), ("minus-one-byte", data[:-1]),
                        ("header-only", data[:4096]), ("magic-only", data[:4])):
        p = tmp_path / f"{label}.gguf"
        p.write_bytes(blob)
        with pytest.raises(ModelError) as exc:
            f = GGUFModelFile(p)  # the gguf reader checks sizes at open; if not, a read must fail
            for name in f.tensor_names():
                f.tensor(name)
        assert p.name in str(exc.value), (label, str(exc.value))
        print(f"\n{label}: {exc.value}")


def test_non_gguf_file_raises_model_error(tmp_path):
    cases = {"text.gguf": b"this is not a model\n" * 50, "empty.gguf": b"",
             "badversion.gguf": b"GGUF" + bytes(range(256)) * 4}
    for fname, blob in cases.items():
        p = tmp_path / fname
        p.write_bytes(blob)
        with pytest.raises(ModelError, match=fname.replace(".", r"\.")):
            GGUFModelFile(p)
    with pytest.raises(ModelError, match="not a GGUF file"):
        GGUFModelFile(tmp_path / "text.gguf")
    with pytest.raises(ModelError, match="not found"):
        GGUFModelFile(tmp_path / "missing.gguf")


def test_unsupported_tensor_type_raises_model_error(tmp_path):
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    path = write_gguf(tmp_path / "odd.gguf", {"ok": (x, QT.Q8_0), "ternary": (x, QT.TQ2_0),
                                              "ints": (np.arange(64).reshape(2, 32), QT.I32)})
    f = GGUFModelFile(path)  # opening is fine: only reading such a tensor is refused
    assert f.tensor("ok", (4, 256)).shape == (4, 256)
    for name, tname in (("ternary", "TQ2_0"), ("ints", "I32")):
        with pytest.raises(ModelError, match=rf"'{name}'.*unsupported type {tname}"):
            f.tensor(name)


def test_wrong_shape_and_missing_tensor_raise_model_error(tmp_path):
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    f = GGUFModelFile(write_gguf(tmp_path / "s.gguf", {"blk.0.attn_q.weight": (x, QT.Q4_0)}))
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_q\.weight'.*\(8, 64\).*expected \(64, 8\)"):
        f.tensor("blk.0.attn_q.weight", (64, 8))  # the transposed (GGUF-order) shape is wrong
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_q\.weight'"):
        f.tensor("blk.0.attn_q.weight", (8 * 64,))
    with pytest.raises(ModelError, match=r"missing tensor 'output\.weight'"):
        f.tensor("output.weight")
    assert f.tensor("blk.0.attn_q.weight", (8, 64)).shape == (8, 64)


def test_model_file_is_parsed_once_while_unchanged(tmp_path, model_path) -> None:
    import shutil

    from sekv_local.models.gguf_file import open_model_file

    copy = tmp_path / "model.gguf"
    shutil.copyfile(model_path, copy)
    first = open_model_file(copy)
    assert open_model_file(copy) is first  # a bench builds an engine per cell: one parse per process
    replaced = tmp_path / "replacement.gguf"
    shutil.copyfile(model_path, replaced)
    replaced.replace(copy)  # another file at the same path (a new inode): parsed again
    assert open_model_file(copy) is not first
    with pytest.raises(ModelError, match="model file not found"):
        open_model_file(tmp_path / "missing.gguf")
