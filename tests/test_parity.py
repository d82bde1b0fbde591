"""Acceptance test of the foundation: the torch reference engine computes what llama.cpp computes.

Teacher-forced on 2048 tokens of natural English (Python's own topic help, deterministic), both
engines with method "full" and 512-token chunks; we compare next-token argmax and the log-prob of
the actual next token.

Two variants:
- same weights: the default GGUF dequantized to an F32 GGUF (bit-identical weight values to what the
  torch engine uses). This isolates the model implementation (RoPE layout, RMS eps, GQA, tied head...)
  and is held to the foundation issue's thresholds (>= 98% argmax agreement, < 0.05 nats).
  Measured: 99.95% argmax agreement (1 near-tie), mean |dlogp| 0.0010 nats, max 0.017.
- default model (Q4_1 weights, Q8_0 embedding): llama.cpp rounds every matmul input to 8-bit blocks,
  which amplifies any fp32 rounding difference (summation order) into ~0.06 nats by the last layer.
  llama.cpp is no closer to itself: its batch-1 (decode) and batched (prefill) paths differ by
  0.065 nats / 97.65% agreement on this text, below the 98% / 0.05 of the issue; bit-exact
  emulation was tried (docs/RESULTS.md, parity section) and does not get closer. So this variant
  measures llama.cpp's own noise floor in the same run and requires the torch engine to be about as
  close to llama.cpp's batched path as llama.cpp's own decode path is (25% / 1 point of slack).
"""

from __future__ import annotations

import numpy as np
import pytest

from sekv_local.engines.base import EngineOptions
from sekv_local.engines.llama_cpp_stock import LlamaCppStockEngine
from sekv_local.engines.torch_engine import TorchEngine

from gguf_copies import f32_copy

N_TOKENS = 2048
MIN_AGREEMENT = 0.98
MAX_MEAN_ABS_DLOGP = 0.05


def pydoc_ids(tokenizer, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of pydoc topics in sorted key order (joined until long enough)."""
    from pydoc_data.topics import topics

    text = ""
    for key in sorted(topics):
        text += topics[key] + "\n\n"
        ids = tokenizer.encode(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise AssertionError(f"pydoc topics are shorter than {n_tokens} tokens")


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    """Exactly 2048 tokens of pydoc topics."""
    return pydoc_ids(tokenizer, N_TOKENS)


def score_both(gguf_path, tokenizer, ids, threads: int = 2) -> tuple[np.ndarray, ...]:
    """Teacher-forced scores of `ids` by both engines (method full, 512-token chunks):
    (torch logp, torch argmax, llama.cpp logp, llama.cpp argmax), each [len(ids) - 1]."""
    options = EngineOptions(method="full", chunk_size=512, threads=threads)
    torch_lp, torch_top = TorchEngine(gguf_path, tokenizer, options).score(ids)
    llama = LlamaCppStockEngine(gguf_path, tokenizer, options)
    try:
        llama_lp, llama_top = llama.score(ids)
    finally:
        llama.close()
    assert torch_lp.shape == llama_lp.shape == (len(ids) - 1,)
    return torch_lp, torch_top, llama_lp, llama_top


def agreement_stats(torch_lp, torch_top, llama_lp, llama_top, label) -> tuple[float, float]:
    """Print and return (argmax agreement, mean |dlogp|) of two engines' scores."""
    agreement = float(np.mean(torch_top == llama_top))
    diff = np.abs(torch_lp.astype(np.float64) - llama_lp)
    print(f"\n[parity {label}] {len(diff)} next-token predictions: argmax agreement {agreement:.2%}, mean |dlogp| "
          f"{diff.mean():.4f} nats, max {diff.max():.4f}, p99 {np.percentile(diff, 99):.4f}, "
          f"mean logp torch {torch_lp.mean():.4f} llama.cpp {llama_lp.mean():.4f}")
    return agreement, float(diff.mean())


def compare(gguf_path, tokenizer, ids, label, threads: int = 2) -> tuple[float, float]:
    """Score `ids` with both engines; print and return (argmax agreement, mean |dlogp|)."""
    return agreement_stats(*score_both(gguf_path, tokenizer, ids, threads), label)


@pytest.mark.slow
def test_parity_same_weights(model_path, tokenizer, text_ids, tmp_path_factory):
    path = tmp_path_factory.mktemp("f32") / "model-f32.gguf"
    f32_copy(model_path, path)
    try:
        agreement, mean_diff = compare(path, tokenizer, text_ids, "same F32 weights")
    finally:
        path.unlink(missing_ok=True)
    assert agreement >= MIN_AGREEMENT
    assert mean_diff < MAX_MEAN_ABS_DLOGP


def llama_noise_floor(gguf_path, tokenizer, ids, threads: int = 2) -> tuple[float, float]:
    """llama.cpp's own noise floor: the same tokens scored one at a time (its decode kernels) vs in
    512-token batches; returns (argmax agreement, mean |dlogp|) between the two."""
    batched = LlamaCppStockEngine(gguf_path, tokenizer, EngineOptions(method="full", chunk_size=512, threads=threads))
    single = LlamaCppStockEngine(gguf_path, tokenizer, EngineOptions(method="full", chunk_size=1, threads=threads))
    try:
        lp_batched, top_batched = batched.score(ids)
        lp_single, top_single = single.score(ids)
    finally:
        batched.close()
        single.close()
    floor_agreement = float(np.mean(top_single == top_batched))
    floor_diff = float(np.abs(lp_single - lp_batched).mean())
    print(f"[parity llama.cpp noise floor] batch-1 vs batched: argmax agreement {floor_agreement:.2%}, "
          f"mean |dlogp| {floor_diff:.4f} nats (issue thresholds {MIN_AGREEMENT:.0%} / {MAX_MEAN_ABS_DLOGP})")
    return floor_agreement, floor_diff


@pytest.mark.slow
def test_parity_default_model(model_path, tokenizer, text_ids):
    agreement, mean_diff = compare(model_path, tokenizer, text_ids, "default Q4_1 model")
    floor_agreement, floor_diff = llama_noise_floor(model_path, tokenizer, text_ids)
    # torch must sit within llama.cpp's own spread (25% / 1 point of slack for thread-count effects);
    # a real model bug (RoPE layout, eps, masking) costs several times more than this
    assert mean_diff <= floor_diff * 1.25, "torch is further from llama.cpp than llama.cpp's two paths are apart"
    assert agreement >= floor_agreement - 0.01
