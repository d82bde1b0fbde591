"""Gemma 3 270M in the native engine: its layer shape (q/k norms, post-norms, GELU, embedding scale, two RoPE
bases), the 15 sliding-window layers in rings of their window, SeKV on the 3 global layers with the packaged
router (the union rule), and native prefill.

One ~3K-token needle document (budget 0.6: below it the 15 windows alone exceed the budget at this length) is
read by the torch engine and by the llama.cpp engine with native prefill, torch first: the torch model is shared
by both engines in one process, so what it runs after that is the llama.cpp engine's. The shipped Q4_K_M
weights: llama.cpp rounds matmul inputs to 8-bit blocks, so the decode parity bounds are loose ones (measured:
KL 7e-5 to 2.2e-3 per step, every argmax and 83-100% of the zoom choices the same) and the native document's
span table may differ from torch's by a few boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from native_sessions import read_with_both_engines
from sekv_local.engines.llama_cpp_sekv import DECODE_ROOM
from sekv_local.eval.tasks import generate_sample
from sekv_local.models import registry
from sekv_local.models.tokenizer import Tokenizer
from sekv_local.native import build
from sekv_local.native.bindings import NativeModel, load_library
from sekv_local.native.memory_export import native_memory, sekv_of
from sekv_local.session import SessionSettings

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def gemma():
    load_library(build.build(log=print))
    path = registry.resolve_model("gemma3-270m", show_progress=False)
    return path, Tokenizer(path)


@pytest.fixture(scope="module")
def sessions(gemma):
    path, tok = gemma
    sample = generate_sample("niah_single", 3000, seed=5, count_tokens=tok.count, depth=0.4)
    settings = SessionSettings(model=str(path), engine="torch", method="sekv", budget=0.6, threads=2,
                               max_new_tokens=16, method_options=(("answer_room", DECODE_ROOM),))
    sessions, torch_tokens = read_with_both_engines(path, tok, sample.document, settings)
    out = {"sample": sample, "torch_tokens": torch_tokens, **sessions}
    out["ingest_torch_tokens"] = sum(torch_tokens)
    return out


def test_the_native_model_reports_its_sliding_window_layers(gemma) -> None:
    model = NativeModel(gemma[0], 2)
    assert model.info.sliding_window == 512
    assert model.local_layers == tuple(i for i in range(18) if i % 6 != 5)  # every sixth layer is global


def test_decode_matches_torch_on_the_torch_memory(gemma, sessions) -> None:
    """The torch engine's memory of the document and a question (the question's pins made), imported natively;
    both decode the same tokens."""
    path, tok = gemma
    engine = sessions["torch"].engine
    mark = engine.mark()
    try:
        engine.feed(tok.encode(f"\n\nQuestion: {sessions['sample'].questions[0].text}\nAnswer:"))
        engine.finish_prefill()
        sekv, layers = sekv_of(engine.cache)
        assert sekv.router_kind == "union" and layers == [5, 11, 17]
        memory = native_memory(NativeModel(path, 2), engine.cache, STEPS + 1)
        logits, steps = engine._last_logits, []
        for _ in range(STEPS):
            token = int(np.argmax(logits))
            sekv.reset_observations()
            reference = engine._forward([token], prefill=False)
            native = memory.decode(token, engine.n_tokens)
            engine.n_tokens += 1
            p, q = (torch.softmax(torch.tensor(x, dtype=torch.float64), -1) for x in (reference, native))
            picked = {(j, h, s) for j, chosen in sekv._zoom_events for h, row in enumerate(chosen.tolist()) for s in row}
            native_picked = {(j, h, int(s)) for j, layer in enumerate(layers)
                             for h, row in enumerate(memory.last_zoom(layer)) for s in row}
            assert all(memory.last_zoom(i).size == 0 for i in range(18) if i not in layers)
            steps.append((float((p * (p.log() - q.log())).sum()), int(reference.argmax()), int(native.argmax()),
                          len(picked & native_picked) / max(len(picked), 1)))
            logits = reference
        memory.close()
    finally:
        engine.rollback(mark)
    print("\n" + "\n".join(str(s) for s in steps))
    assert all(a == b for _, a, b, _ in steps)
    assert max(kl for kl, *_ in steps) < 0.01
    assert np.mean([z for *_, z in steps]) >= 0.9


def test_native_prefill_reads_the_document_without_torch(sessions) -> None:
    """No torch forward pass for the document's chunks or the answers folded back; the memory is torch's up to a
    few span boundaries (surprisal from 8-bit activations); both answer two questions alike."""
    assert sessions["ingest_torch_tokens"] == 0
    caches = {e: sekv_of(sessions[e].engine.cache if e == "torch" else sessions[e].engine.reference.cache)[0]
              for e in ("torch", "llama.cpp")}
    spans = {e: c.span_len.length for e, c in caches.items()}
    print(spans)
    assert abs(spans["torch"] - spans["llama.cpp"]) <= 0.1 * spans["torch"]
    windows = {e: (sessions[e].engine.cache if e == "torch" else sessions[e].engine.reference.cache).windows
               for e in ("torch", "llama.cpp")}
    for i, window in windows["torch"].items():  # the windows' rows: the same positions, rows close (8-bit noise)
        other = windows["llama.cpp"][i]
        assert (window.start, window.length) == (other.start, other.length)
        for a, b in ((other.keys(), window.keys()), (other.values(), window.values())):
            relative = float((a.float() - b.float()).norm() / b.float().norm())
            print(i, relative)
            assert relative < 0.1
    # a second question: the first answer folds back into the torch memory from the native rows, no forward pass
    for question in (sessions["sample"].questions[0].text, "What is the document about?"):
        torch_answer = sessions["torch"].answer(question)
        before = sum(sessions["torch_tokens"])
        native_answer = sessions["llama.cpp"].answer(question)
        print([torch_answer.text, native_answer.text], sum(sessions["torch_tokens"]) - before)
        assert torch_answer.text == native_answer.text
        # the question's chunk only (select=question's exact pass)
        assert 0 < sum(sessions["torch_tokens"]) - before < 40
    assert sessions["sample"].questions[0].answers[0] in sessions["llama.cpp"].turns[0].answer
