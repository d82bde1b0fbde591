"""Native host rows kept between native memories (sekv_host_rows): a memory that borrows them decodes as one
that owns a copy of the same rows, rows synced a piece at a time are the rows synced at once, a rollback's
replaced spans are rebuilt, and a memory whose rows moved refuses to step instead of reading freed rows."""

from __future__ import annotations

import numpy as np
import pytest

from sekv_local.engines.base import EngineOptions
from sekv_local.engines.llama_cpp_sekv import LlamaCppSekvEngine
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.errors import SekvError
from sekv_local.eval.tasks import generate_sample
from sekv_local.native import build
from sekv_local.native.bindings import NativeModel, load_library
from sekv_local.native.host_rows import HostRowsMirror
from sekv_local.native.memory_export import native_memory, sekv_of

STEPS = 6


@pytest.fixture(scope="module")
def native_model(model_path):
    load_library(build.build(log=print))
    return NativeModel(model_path, 2)


def _document(tokenizer, tokens: int = 1500) -> tuple[list[int], list[int]]:
    sample = generate_sample("niah_single", tokens, seed=7, count_tokens=tokenizer.count, depth=0.5)
    return tokenizer.encode(sample.document), tokenizer.encode(f"\n\nQuestion: {sample.questions[0].text}\nAnswer:")


def _torch_engine(model_path, tokenizer, n_tokens: int) -> TorchEngine:
    engine = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25, threads=2))
    engine.reserve(n_tokens)
    return engine


def _decode(memory, engine: TorchEngine, steps: int = STEPS) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Greedy native steps from the torch engine's last logits: (logits of each step, zoom choices of layer 0)."""
    token, position, logits, zooms = int(np.argmax(engine._last_logits)), engine.n_tokens, [], []
    for _ in range(steps):
        out = memory.decode(token, position)
        logits.append(out)
        zooms.append(memory.last_zoom(0).copy())
        token, position = int(np.argmax(out)), position + 1
    return logits, zooms


def test_borrowed_rows_decode_as_owned_rows_and_pieces_as_whole(native_model, model_path, tokenizer) -> None:
    doc, question = _document(tokenizer)
    engine = _torch_engine(model_path, tokenizer, len(doc) + len(question) + 64)
    piecewise = HostRowsMirror(native_model)
    half = len(doc) // 2
    engine.feed(doc[:half])
    sekv, layers = sekv_of(engine.cache)
    piecewise.sync(sekv, layers)
    first = piecewise.rows.count
    assert 0 < first == sekv.span_len.length
    engine.feed(doc[half:])
    engine.finish_prefill()
    engine.feed(question)
    engine.finish_prefill()
    S = sekv.span_len.length
    piecewise.sync(sekv, layers)
    assert piecewise.rebuilt == S - first > 0  # only the spans made since
    piecewise.sync(sekv, layers)
    assert piecewise.rebuilt == 0
    whole = HostRowsMirror(native_model)
    whole.sync(sekv, layers)

    owned = native_memory(native_model, engine.cache, 64, decompress=True)
    on_pieces = native_memory(native_model, engine.cache, 64, host_rows=piecewise.rows)
    on_whole = native_memory(native_model, engine.cache, 64, host_rows=whole.rows)
    assert on_pieces.bytes().host == 0 < owned.bytes().host  # the rows are counted once, by their owner
    assert piecewise.bytes() >= owned.bytes().host * 0.9
    ref, ref_zoom = _decode(owned, engine)
    got, got_zoom = _decode(on_pieces, engine)
    again, _ = _decode(on_whole, engine)
    for a, b, c in zip(ref, got, again):
        assert np.array_equal(b, c)  # the same rows, whichever way they were synced
        assert int(a.argmax()) == int(b.argmax())
        assert float(np.abs(a - b).max()) < 1e-2  # padding to l_max changes only the summation order
    for a, b in zip(ref_zoom, got_zoom):
        assert np.array_equal(a, b)
    for memory in (owned, on_pieces, on_whole):
        memory.close()


def test_rollback_rebuilds_replaced_spans_and_stale_memories_refuse(native_model, model_path, tokenizer) -> None:
    doc, question = _document(tokenizer, 2000)
    other = tokenizer.encode(" The lighthouse keeper wrote a long letter about the weather and the sea." * 40)
    engine = _torch_engine(model_path, tokenizer, len(doc) + len(other) + len(question) + 64)
    engine.feed(doc[:700])
    sekv, layers = sekv_of(engine.cache)
    mirror = HostRowsMirror(native_model)
    mirror.sync(sekv, layers)
    mark = engine.mark()
    held = sekv.span_len.length
    engine.feed(doc[700:])
    mirror.sync(sekv, layers)
    assert sekv.span_len.length > held and mirror.rebuilt == sekv.span_len.length - held
    stale = native_memory(native_model, engine.cache, 64, host_rows=mirror.rows)
    engine.rollback(mark)
    engine.feed(other)
    engine.finish_prefill()
    engine.feed(question)
    engine.finish_prefill()
    mirror.sync(sekv, layers)
    assert mirror.rows.count == sekv.span_len.length and mirror.rebuilt == sekv.span_len.length - held
    with pytest.raises(SekvError, match="moved or replaced"):
        stale.decode(1, engine.n_tokens)
    stale.close()
    fresh = HostRowsMirror(native_model)
    fresh.sync(sekv, layers)
    a = native_memory(native_model, engine.cache, 64, host_rows=mirror.rows)
    b = native_memory(native_model, engine.cache, 64, host_rows=fresh.rows)
    for x, y in zip(_decode(a, engine)[0], _decode(b, engine)[0]):
        assert np.array_equal(x, y)
    a.close()
    b.close()


def test_a_second_question_rebuilds_only_its_new_spans(model_path, tokenizer) -> None:
    load_library(build.build(log=print))
    doc, question = _document(tokenizer, 2000)
    engine = LlamaCppSekvEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25, threads=2))
    engine.reserve(len(doc) + 2 * len(question) + 200)
    engine.feed(doc)
    engine.finish_prefill()
    total = engine.sekv.span_len.length
    assert engine.host_rows.rows.count > 0  # synced while the document was read
    for ask in range(2):
        engine.feed(question)
        engine.finish_prefill()
        list(engine.generate(24, stop_ids=frozenset()))
        assert engine.host_rows.rebuilt < max(total // 4, 1)  # the import found nearly every span held
        report = engine.memory()
        assert report.host_bytes >= engine.host_rows.bytes() + engine.reference.memory().host_bytes
