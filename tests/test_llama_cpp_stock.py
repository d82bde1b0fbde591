"""The stock llama.cpp engine on the real default model: answers, rollback, KV accounting, errors."""

from __future__ import annotations

import numpy as np
import pytest

from sekv_local.engines import create_engine
from sekv_local.engines.base import EngineOptions
from sekv_local.engines.llama_cpp_stock import LlamaCppStockEngine
from sekv_local.errors import SekvError
from sekv_local.models.prompt import PromptBuilder
from sekv_local.models.tokenizer import StreamDecoder

DOC = ("The lighthouse keeper of Port Alder is Maren Holt. She has kept the light for eleven years. "
       + " ".join(["The harbour is quiet in winter. Fishing boats come back before dark."] * 6))
QUESTION = "Who is the lighthouse keeper of Port Alder?"


@pytest.fixture(scope="module")
def engine(model_path, tokenizer):
    eng = create_engine("llama.cpp-stock", model_path, tokenizer, EngineOptions(threads=2, chunk_size=256))
    yield eng
    eng.close()


def answer(engine, tokenizer, prompt_ids, max_new=24) -> str:
    engine.feed(prompt_ids)
    dec = StreamDecoder(tokenizer)
    return "".join(dec.push(t) for t in engine.generate(max_new)) + dec.flush()


def test_greedy_answer_and_rollback(engine, tokenizer):
    pb = PromptBuilder(tokenizer)
    prefix, doc = pb.document_tokens(DOC)
    engine.reset()
    engine.feed(prefix + doc)
    engine.finish_prefill()
    mark = engine.mark()
    n_doc = engine.n_tokens
    first = answer(engine, tokenizer, pb.turn_tokens([], QUESTION))
    assert "Maren" in first, first
    engine.rollback(mark)
    assert engine.n_tokens == n_doc
    other = answer(engine, tokenizer, pb.turn_tokens([], "When is the harbour quiet?"))
    assert other and other != first
    engine.rollback(mark)
    again = answer(engine, tokenizer, pb.turn_tokens([], QUESTION))
    assert again == first
    engine.rollback(mark)
    assert engine.n_tokens == n_doc


def test_defaults_and_memory_of_full(engine):
    cfg = engine.config
    assert engine.name == "llama.cpp-stock"
    assert engine.max_context() == cfg.context_length == 8192
    engine.reset()
    engine.feed([1, 2, 3, 4, 5])
    mem = engine.memory()
    # llama.cpp logs "KV buffer size = 180.00 MiB" for this model at n_ctx 8192 (f16 K and V).
    assert mem.device_bytes == mem.device_peak_bytes == 180 * 2**20
    assert mem.tokens == 5 and mem.host_bytes == 0
    assert mem.full_kv_bytes == cfg.full_kv_bytes(5)
    assert len(mem.device_per_layer) == cfg.n_layers and sum(mem.device_per_layer) == mem.device_bytes
    engine.reset()
    assert engine.n_tokens == 0


def test_score_matches_feed_and_leaves_reset(engine, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    engine.reset()
    engine.feed(ids)
    last = engine._last_logits
    logprobs, argmax = engine.score(ids + [0])
    assert engine.n_tokens == 0 and engine._last_logits is None
    assert logprobs.shape == argmax.shape == (len(ids),)
    assert np.all(logprobs <= 0) and np.all(np.isfinite(logprobs))
    assert argmax[-1] == int(np.argmax(last))


def test_quantized_kv_memory_ratio(model_path, tokenizer):
    sizes = {}
    for method in ("full", "quant-q8_0", "quant-q4_0"):
        eng = LlamaCppStockEngine(model_path, tokenizer,
                                  EngineOptions(method=method, threads=2, method_options={"n_ctx": 512}))
        try:
            assert eng.max_context() == 512
            sizes[method] = eng.memory().device_bytes
        finally:
            eng.close()
    cfg_row = 30 * 3 * 64  # layers x KV heads x head dim of SmolLM2-135M
    assert sizes["full"] == 512 * 2 * cfg_row * 2
    assert sizes["quant-q8_0"] / sizes["full"] == pytest.approx(34 / 64)
    assert sizes["quant-q4_0"] / sizes["full"] == pytest.approx(18 / 64)


def test_quantized_kv_still_answers(model_path, tokenizer):
    pb = PromptBuilder(tokenizer)
    prefix, doc = pb.document_tokens(DOC)
    eng = LlamaCppStockEngine(model_path, tokenizer,
                              EngineOptions(method="quant-q8_0", threads=2, method_options={"n_ctx": 512}))
    try:
        eng.feed(prefix + doc)
        assert "Maren" in answer(eng, tokenizer, pb.turn_tokens([], QUESTION))
    finally:
        eng.close()


@pytest.mark.parametrize("options, message", [
    (EngineOptions(method="sekv"), "--engine torch"),
    (EngineOptions(method="full", budget=0.5), "budget"),
    (EngineOptions(method="full", method_options={"n_ctx": 0}), "n_ctx"),
    (EngineOptions(method="full", method_options={"window": 3}), "unknown option"),
])
def test_refused_options(model_path, tokenizer, options, message):
    with pytest.raises(SekvError, match=message):
        LlamaCppStockEngine(model_path, tokenizer, options)
