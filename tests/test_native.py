"""The native engine (native/: llama.cpp from the pinned sdist + sekv-native) against the torch engine.

Parity: the torch engine builds a SeKV memory (2K-token document, 25% budget, so spans are zoomed);
the same memory is imported into the native library and both decode the same tokens. With the same
F32 weights in both engines, the next-token distributions and the spans each layer zooms into must
match; with the default Q4_1 model llama.cpp rounds matmul inputs to 8-bit blocks, so only the argmax
and a looser KL are required (the foundation parity test measures that noise floor).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import time

import numpy as np
import pytest
import torch

from gguf_copies import f32_copy
from native_sessions import read_with_both_engines
from sekv_local.documents import Document
from sekv_local.engines.base import EngineOptions
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.errors import SekvError
from sekv_local.eval.tasks import generate_sample
from sekv_local.native import build, cuda
from sekv_local.native.bindings import NativeMemory, NativeModel, load_library
from sekv_local.native.memory_export import native_memory
from sekv_local.session import Session, SessionSettings

STEPS = 8


@pytest.fixture(scope="module")
def library():
    return build.build(log=print)


@pytest.fixture(scope="module")
def f32_model(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("f32") / "model-f32.gguf"
    f32_copy(model_path, path)
    yield path
    path.unlink(missing_ok=True)


def test_build_is_cached_by_its_inputs(library) -> None:
    start = time.perf_counter()
    again = build.build()
    assert again == library and time.perf_counter() - start < 5  # a cache hit compiles nothing
    if shutil.which("nvcc"):  # a CUDA plan needs the toolkit to say where it lives
        assert build.BuildPlan.create(cuda=True).key() != build.BuildPlan.create(cuda=False).key()
    assert library.parent.name == build.BuildPlan.create().key()


@pytest.mark.slow
def test_cuda_sources_of_the_decode_graph_compile_for_ampere_and_hopper() -> None:
    """llama.cpp's own CUDA build configuration (cuBLAS from PyPI when the toolkit lacks it); every ggml
    op the decode graph uses must compile to device code for sm_86 and sm_90. Needs nvcc, not a GPU."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine")
    result = cuda.compile_check(("86", "90"), log=print)
    assert {o.name for o in result.objects} == {f"{name}.cu.o" for name in cuda.DECODE_GRAPH_SOURCES}
    for obj in result.objects:
        assert cuda.embedded_archs(obj) == {"86", "90"}, obj.name


def test_only_the_sekv_api_leaves_the_library(library) -> None:
    lib = load_library(library)
    assert hasattr(lib, "sekv_decode")
    for private in ("llama_decode", "ggml_mul_mat", "llama_model_load_from_file"):
        with pytest.raises(AttributeError):
            getattr(lib, private)
    import llama_cpp  # a stock llama-cpp-python in the same process keeps working

    assert llama_cpp.llama_max_devices() >= 1


def decode_side_by_side(gguf, tokenizer, library, options=None, decompress: bool = False,
                        scheduler: bool = False, on_model=None) -> list[dict]:
    """Torch SeKV memory of a 2K-token needle document + question, imported natively; STEPS greedy
    steps decoded by both engines on the same tokens. Per step: KL(torch || native), max |dlogit|,
    both argmaxes, and the share of torch's (layer, KV head, span) zoom choices the native graph made.
    Routing at every step (select=step) unless the options say otherwise; with select=question the
    question's pins are made (finish_prefill) before the import."""
    load_library(library)
    options = {"select": "step", **(options or {})}
    sample = generate_sample("niah_single", 2000, seed=7, count_tokens=tokenizer.count, depth=0.5)
    doc = tokenizer.encode(sample.document)
    question = tokenizer.encode(f"\n\nQuestion: {sample.questions[0].text}\nAnswer:")
    engine = TorchEngine(gguf, tokenizer, EngineOptions(method="sekv", budget=0.25, threads=2,
                                                        method_options=options))
    engine.reserve(len(doc) + len(question) + 64)
    engine.feed(doc)
    engine.finish_prefill()
    engine.feed(question)
    if options["select"] == "question":
        engine.finish_prefill()
    assert engine.cache.span_len.length > engine.cache.decode_zoom_k() > 0  # some spans zoomed, some not
    model = NativeModel(gguf, 2)
    if on_model is not None:
        on_model(model, engine)
    memory = native_memory(model, engine.cache, 64, decompress=decompress, scheduler=scheduler)
    logits, steps = engine._last_logits, []
    spans = engine.cache.span_len.length
    for _ in range(STEPS):
        token = int(np.argmax(logits))
        engine.cache.reset_observations()
        reference = engine._forward([token], prefill=False)
        if engine.cache.span_len.length != spans:
            break  # torch compressed its pending rows into new spans; the native memory does that at fold-back
        native = memory.decode(token, engine.n_tokens)
        engine.n_tokens += 1
        p, q = torch.softmax(torch.tensor(reference, dtype=torch.float64), -1), \
            torch.softmax(torch.tensor(native, dtype=torch.float64), -1)
        picked = {(layer, h, s) for layer, chosen in engine.cache._zoom_events
                  for h, row in enumerate(chosen.tolist()) for s in row}
        native_picked = {(layer, h, int(s)) for layer in range(engine.config.n_layers)
                         for h, row in enumerate(memory.last_zoom(layer)) for s in row}
        slots = [(layer, h, i, s) for layer, chosen in engine.cache._zoom_events
                 for h, row in enumerate(chosen.tolist()) for i, s in enumerate(row)]
        native_slots = {(layer, h, i, int(s)) for layer in range(engine.config.n_layers)
                        for h, row in enumerate(memory.last_zoom(layer)) for i, s in enumerate(row)}
        steps.append({"kl": float((p * (p.log() - q.log())).sum()), "max_dlogit": float(np.abs(reference - native).max()),
                      "argmax": (int(reference.argmax()), int(native.argmax())),
                      # how far below torch's top logit torch puts the native argmax (0 when they agree)
                      "margin": float(reference.max() - reference[int(native.argmax())]),
                      "zoom_agreement": len(picked & native_picked) / len(picked),
                      # slots the learned router left empty (-1), and how many of them native left empty too
                      "empty_slots": sum(s < 0 for *_, s in slots),
                      "empty_agreement": sum(1 for t in slots if t[-1] < 0 and t in native_slots)})
        logits = reference
    memory.close()
    print("\n" + "\n".join(str(s) for s in steps))
    assert len(steps) >= 4
    return steps


@pytest.mark.slow
def test_parity_with_torch_on_the_same_weights(f32_model, tokenizer, library) -> None:
    steps = decode_side_by_side(f32_model, tokenizer, library)
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
        assert s["max_dlogit"] < 0.15
        assert s["zoom_agreement"] >= 0.95  # the rest: near-ties at the top-k boundary (f16 scores)
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99


@pytest.mark.slow
def test_parity_with_torch_on_the_default_model(model_path, tokenizer, library) -> None:
    steps = decode_side_by_side(model_path, tokenizer, library)
    # Q4_1 weights: llama.cpp multiplies them with 8-bit activations, torch with float32 ones, so logits differ by
    # up to ~0.7; the argmaxes may differ only where torch's top two are closer than that, and rarely
    differ = [s for s in steps if s["argmax"][0] != s["argmax"][1]]
    assert all(s["margin"] <= s["max_dlogit"] for s in differ), differ
    assert len(differ) <= max(1, len(steps) // 4), differ
    assert np.mean([s["kl"] for s in steps]) < 5e-3
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.97


def prefill_side_by_side(gguf, tokenizer, library, chunk: int, options=None) -> dict:
    """Torch SeKV memory of the first part of a 2K-token needle document, imported natively; the next `chunk`
    tokens read by both engines as one prefill chunk, natively first. The torch chunk then zooms into the
    spans the native one chose: a routing margin of a few thousandths of a logit (there are such near ties in
    this document) flips with float rounding and changes every later layer, which would hide whether the
    attention itself agrees. Returns the last token's logits, the chunk's surprisal, its new K/V rows and how
    often torch's own choice agreed with the native one."""
    load_library(library)
    sample = generate_sample("niah_single", 2000, seed=7, count_tokens=tokenizer.count, depth=0.5)
    doc = tokenizer.encode(sample.document)
    engine = TorchEngine(gguf, tokenizer, EngineOptions(method="sekv", budget=0.25, threads=2,
                                                        method_options={"select": "step", **(options or {})}))
    engine.reserve(len(doc))
    assert chunk <= engine.cache.chunk_tokens
    head, tail = doc[: len(doc) - chunk], doc[len(doc) - chunk:]
    engine.feed(head)
    cache = engine.cache
    assert cache.span_len.length > cache.zoom_k > 0  # some spans zoomed, some not
    model = NativeModel(gguf, 2)
    memory = native_memory(model, cache, chunk + 1, zoom_k=cache.zoom_k)
    first = memory.n_exact
    seen = {}
    end_chunk = cache.end_chunk

    def capture(scores, ids):  # before the chunk's rows fold into spans
        seen["nll"] = scores.nll.float().cpu().numpy()
        seen["k"] = torch.stack([l.pend_k.view()[:, -chunk:] for l in cache.layers]).float().numpy()
        seen["v"] = torch.stack([l.pend_v.view()[:, -chunk:] for l in cache.layers]).float().numpy()
        end_chunk(scores, ids)

    own_route, own_choice = cache._route, set()

    def follow_native(layer, *args, **kwargs):
        chosen = own_route(layer, *args, **kwargs)
        own_choice.update((layer, h, s) for h, row in enumerate(chosen.tolist()) for s in row)
        return torch.tensor(memory.last_zoom(layer), dtype=chosen.dtype).view(chosen.shape)

    cache.end_chunk, cache._route = capture, follow_native
    position = engine.n_tokens
    rows = cache.score_rows(torch.tensor(tail))  # the torch chunk adds nothing to the shortlist after this
    nll, logits = memory.prefill(tail, position, score_rows=None if rows is None else rows.numpy())
    torch_logits = engine._forward(tail, prefill=True)
    rows = [memory.get_exact(layer, first, chunk) for layer in range(engine.config.n_layers)]
    native_zoom = {(layer, h, int(s)) for layer in range(engine.config.n_layers)
                   for h, row in enumerate(memory.last_zoom(layer)) for s in row}
    memory.close()
    p, q = (torch.softmax(torch.tensor(x, dtype=torch.float64), -1) for x in (torch_logits, logits))
    return {"kl": float((p * (p.log() - q.log())).sum()), "argmax": (int(torch_logits.argmax()), int(logits.argmax())),
            "nll": (seen["nll"], nll), "k": (seen["k"], np.stack([r[0] for r in rows]).astype(np.float32)),
            "v": (seen["v"], np.stack([r[1] for r in rows]).astype(np.float32)),
            "zoom_agreement": len(own_choice & native_zoom) / max(len(own_choice), 1)}


@pytest.mark.slow
@pytest.mark.parametrize("chunk,vocab", [(1, "all"), (96, "all"), (96, 500)])
def test_a_prefill_chunk_matches_torch_on_the_same_weights(chunk, vocab, f32_model, tokenizer, library) -> None:
    """vocab 500: surprisal over a shortlist (the first 500 rows and the document's tokens), in both engines."""
    got = prefill_side_by_side(f32_model, tokenizer, library, chunk, {"surprisal_vocab": vocab})
    print({k: got[k] for k in ("kl", "argmax", "zoom_agreement")},
          {k: float(np.abs(a - b).max(initial=0)) for k, (a, b) in ((n, got[n]) for n in ("nll", "k", "v"))})
    assert got["argmax"][0] == got["argmax"][1]
    assert got["kl"] < 1e-4
    assert got["nll"][0].shape == got["nll"][1].shape == (chunk - 1,)
    np.testing.assert_allclose(got["nll"][1], got["nll"][0], atol=0.02)
    np.testing.assert_allclose(got["k"][1], got["k"][0], atol=0.02, rtol=0.01)  # f16 rows
    np.testing.assert_allclose(got["v"][1], got["v"][0], atol=0.02, rtol=0.01)
    assert got["zoom_agreement"] >= 0.95


def pinned_spans(engine) -> int:
    """Pinned (layer, span) pairs of the torch memory's current answer."""
    n = engine.cache.span_len.length
    return sum(int(p.mask_for(n).sum()) for p in map(engine.cache.pins, range(engine.config.n_layers)) if p is not None)


@pytest.mark.slow
@pytest.mark.parametrize("router", ["attention", "learned"])
def test_parity_with_question_time_pins(router, f32_model, f32_model_with_router, tokenizer, library) -> None:
    """select=question: the spans the question attended to are pinned per layer, attended as exact rows
    with their summary rows out, and never routed; the few routed slots go to other spans. The learned
    router (no fill) leaves slots empty where too few unpinned spans pass, and may rank a pinned span
    into an empty slot: the graph must mask it."""
    gguf = f32_model if router == "attention" else f32_model_with_router[0]
    options = {"select": "question"} | ({"energy": 0.9, "fill": False} if router == "learned" else {})
    seen = {}

    def pins_imported(model, engine) -> None:
        seen["pinned"] = pinned_spans(engine)
        seen["pool"], seen["slots"] = engine.cache.zoom_k, engine.cache.decode_zoom_k()

    steps = decode_side_by_side(gguf, tokenizer, library, options, decompress=True, on_model=pins_imported)
    assert seen["pinned"] > 0 and seen["slots"] < seen["pool"]  # pins carry the question; few routed slots
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99
    if router == "learned":
        assert sum(s["empty_agreement"] for s in steps) >= 0.99 * sum(s["empty_slots"] for s in steps)


@pytest.mark.slow
def test_parity_with_factored_spans(f32_model, tokenizer, library) -> None:
    """Low-rank spans (energy 0.9): rows rebuilt as U W and rotated inside the graph."""
    steps = decode_side_by_side(f32_model, tokenizer, library, {"energy": 0.9})
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99


@pytest.mark.slow
def test_parity_with_rows_rebuilt_at_import(f32_model, tokenizer, library) -> None:
    """The engine's default host form: every span rebuilt to rows once (energy 0.9: low-rank spans too)."""
    steps = decode_side_by_side(f32_model, tokenizer, library, {"energy": 0.9}, decompress=True)
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99


@pytest.mark.slow
def test_parity_through_the_multi_backend_scheduler(f32_model, tokenizer, library) -> None:
    """The path a GPU model takes (ggml's scheduler; host-tier buffers marked as weights so the ops that
    read them stay on the CPU), run here on the CPU backend alone: the same results as the direct path."""
    steps = decode_side_by_side(f32_model, tokenizer, library, {"energy": 0.9}, scheduler=True)
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99


def learned_router_params(config, seed: int = 0):
    """A router with every parameter moved and thresholds spread so that per step some KV groups pass
    fewer spans than the top-k has slots (the -1 path) and others fill them."""
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router
    from sekv_local.sekv.router_file import params_of

    router = Router(config, SekvConfig())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.q_proj.add_(0.1 * torch.randn(router.q_proj.shape, generator=gen))
        router.threshold_logit.copy_(3.0 + 3.0 * torch.rand(router.threshold_logit.shape, generator=gen))
    return params_of(router, config, {"routing_dim": router.routing_dim}, {"note": "native parity test"})


@pytest.fixture(scope="module")
def f32_model_with_router(f32_model, tmp_path_factory):
    from sekv_local.converters.bake import bake
    from sekv_local.models.gguf_file import GGUFModelFile
    from sekv_local.sekv.router_file import save_router

    folder = tmp_path_factory.mktemp("router")
    params = learned_router_params(GGUFModelFile(f32_model).config)
    path = bake(f32_model, save_router(folder / "router.safetensors", params), folder / "model-f32-router.gguf")
    yield path, params
    path.unlink(missing_ok=True)


@pytest.mark.slow
def test_parity_with_the_learned_router_read_from_the_gguf(f32_model_with_router, tokenizer, library) -> None:
    """The router baked into the GGUF: the native loader reads it (the same numbers the torch engine uses)
    and the decode graph routes with it, including slots it leaves empty when too few spans pass."""
    path, params = f32_model_with_router

    def read_by_the_native_loader(model, engine) -> None:
        assert engine.cache.router_kind == "projection"
        q_proj, threshold = model.router()
        assert np.array_equal(q_proj, params.tensors["q_proj"].numpy())
        assert np.array_equal(threshold, params.tensors["threshold_logit"].numpy())

    steps = decode_side_by_side(path, tokenizer, library, {"energy": 0.9, "fill": False},
                                on_model=read_by_the_native_loader)
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
        assert s["zoom_agreement"] >= 0.95
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99
    empty = sum(s["empty_slots"] for s in steps)
    assert empty > 0 and sum(s["empty_agreement"] for s in steps) >= 0.99 * empty


@pytest.mark.slow
def test_parity_with_the_learned_router_filling_the_pool(f32_model_with_router, tokenizer, library) -> None:
    """`fill=true`: the same router, its thresholds ignored: no slot stays empty in either engine, and the
    engines still zoom into the same spans and agree on the next token."""
    path, _ = f32_model_with_router
    steps = decode_side_by_side(path, tokenizer, library, {"energy": 0.9, "fill": True})
    assert sum(s["empty_slots"] for s in steps) == 0
    for s in steps:
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-4
        assert s["zoom_agreement"] >= 0.95
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99


def test_a_malformed_router_in_the_gguf_fails_the_load(model_path, library, tmp_path) -> None:
    from sekv_local.converters.bake import _write_copy
    from sekv_local.models.gguf_file import GGUFModelFile
    from sekv_local.sekv.router_file import PREFIX, gguf_entries

    load_library(library)
    source = GGUFModelFile(model_path)
    entries = gguf_entries(learned_router_params(source.config))
    short = [(k, v[:-1] if k == "sekv.blk.3.q_proj" else v, kind) for k, v, kind in entries]
    _write_copy(source, short, PREFIX, tmp_path / "short.gguf", None)
    with pytest.raises(SekvError, match="'sekv.blk.3.q_proj' must hold 2048 numbers, got 2047"):
        NativeModel(tmp_path / "short.gguf", 1)
    other = [(k, 4 if k == "sekv.n_heads" else v, kind) for k, v, kind in entries]
    _write_copy(source, other, PREFIX, tmp_path / "other.gguf", None)
    with pytest.raises(SekvError, match="trained for another model: n_heads 4 \\(model: 9\\)"):
        NativeModel(tmp_path / "other.gguf", 1)


def test_router_set_from_python_is_checked(model_path, library) -> None:
    load_library(library)
    model = NativeModel(model_path, 1)
    assert model.router_dim == 0 and model.router() is None  # the stock GGUF carries none
    counts = np.zeros((model.info.n_layer, 2), dtype=np.int32)
    with pytest.raises(SekvError, match="no learned router"):
        NativeMemory(model, 16, 0, 8, 4, 2, 1.0, counts, counts, learned_router=True)
    L, D, H = model.info.n_layer, model.info.head_dim, model.info.n_head
    q_proj, threshold = np.random.default_rng(0).standard_normal((L, D, 16)), np.zeros((L, H))
    with pytest.raises(SekvError, match="do not fit the model"):
        model.set_router(q_proj[:, :, :, None], threshold)
    q_proj[2, 3, 4] = np.nan
    with pytest.raises(SekvError, match="non-finite"):
        model.set_router(q_proj, threshold)
    q_proj[2, 3, 4] = 0.5
    model.set_router(q_proj, threshold)
    assert model.router_dim == 16 and np.array_equal(model.router()[0], q_proj.astype(np.float32))
    memory = NativeMemory(model, 16, 0, 8, 4, 2, 1.0, counts, counts)
    with pytest.raises(SekvError, match="made without the learned router"):
        memory.set_layer_routing(0, np.zeros((model.info.n_head_kv, 0, 16), dtype=np.float16))


def test_gpu_request_without_a_gpu_backend_is_refused(model_path, library) -> None:
    lib = load_library(library)  # the CPU build: asking it for a GPU must fail with a reason, not crash
    assert not lib.sekv_model_load_on(str(model_path).encode(), 1, 1)
    assert "no GPU" in lib.sekv_last_error().decode()
    if not cuda.gpu_visible():  # and the Python side says so before building a CUDA library for nothing
        with pytest.raises(SekvError, match="no GPU"):
            NativeModel(model_path, 1, gpu=True)


def test_memory_params_are_checked(model_path, library) -> None:
    load_library(library)
    model = NativeModel(model_path, 1)
    counts = np.zeros((model.info.n_layer, 2), dtype=np.int32)
    with pytest.raises(SekvError, match="n_factored \\+ n_raw == n_spans"):
        NativeMemory(model, 16, 3, 8, 4, 2, 1.0, counts, counts)  # 3 spans, none stored
    memory = NativeMemory(model, 16, 0, 8, 4, 2, 1.0, counts, counts)
    with pytest.raises(SekvError, match="different numbers of exact rows|exact rows"):
        k = np.zeros((model.info.n_head_kv, 4, model.info.head_dim), dtype=np.float16)
        memory.set_exact(0, k, k)
        memory.decode(1, 4)
    with pytest.raises(SekvError, match="below exact_capacity"):
        big = np.zeros((model.info.n_head_kv, 16, model.info.head_dim), dtype=np.float16)
        memory.set_exact(0, big, big)
    with pytest.raises(SekvError, match="could not load"):
        NativeModel("/nonexistent.gguf", 1)


def test_a_memory_that_routes_with_the_learned_router_counts_its_parameters(model_path, library) -> None:
    """The router's q_proj and thresholds live in the model's buffer, but only a memory that routes with them
    needs them: its device bytes include them."""
    load_library(library)
    model = NativeModel(model_path, 1)
    i = model.info
    q_proj = np.zeros((i.n_layer, i.head_dim, 32), dtype=np.float32)
    threshold = np.zeros((i.n_layer, i.n_head), dtype=np.float32)
    model.set_router(q_proj, threshold)
    raw = np.full((i.n_layer, 2), 3, dtype=np.int32)
    device = {}
    for learned in (False, True):
        memory = NativeMemory(model, 16, 3, 8, 4, 2, 1.0, np.zeros_like(raw), raw, learned_router=learned)
        device[learned] = memory.bytes().device
        memory.close()
    routing_keys = i.n_layer * i.n_head_kv * 3 * 32 * 2  # f16 [d', S, KV] per layer
    assert device[True] - device[False] >= q_proj.nbytes + threshold.nbytes + routing_keys


def session(engine: str, document: str, tokenizer, **kw) -> Session:
    settings = SessionSettings(engine=engine, method="sekv", budget=0.25, threads=2, max_new_tokens=24, **kw)
    s = Session.create(Document.from_text(document), settings, show_progress=False, tokenizer=tokenizer)
    s.ingest()
    return s


@pytest.mark.slow
def test_llama_cpp_engine_answers_like_torch(tokenizer, library, monkeypatch) -> None:
    """Two questions on one document: the same greedy answers as the torch engine, with the native
    memory folded back into torch every 8 generated tokens (positions and turns stay consistent)."""
    from sekv_local.engines import llama_cpp_sekv

    monkeypatch.setattr(llama_cpp_sekv, "DECODE_ROOM", 8)
    sample = generate_sample("niah_multikey", 2000, seed=11, count_tokens=tokenizer.count, depth=0.3)
    # the llama.cpp engine's pins leave room for its decode room (answer_room): the torch side alike
    reference = session("torch", sample.document, tokenizer, method_options=(("answer_room", 8),))
    native = session("llama.cpp", sample.document, tokenizer, method_options=(("prefill", "torch"),))
    answers = []
    # the second turn asks for the fact again: open-ended text can part at a near-tie token, since the
    # engines run different (Q4 native vs dequantized f32) kernels; this test is about turns and fold-back
    for question in (sample.questions[0].text, "Tell me once more: " + sample.questions[0].text):
        a, b = reference.answer(question), native.answer(question)
        print(f"\ntorch: {a.text!r}\nllama.cpp: {b.text!r}")
        assert a.text == b.text
        assert b.n_tokens > 8  # at least one fold-back happened
        answers.append(b.text)
    memory = native.engine.memory()
    assert memory.device_peak_bytes <= 0.25 * memory.full_kv_bytes
    assert memory.host_bytes > memory.device_bytes
    assert native.engine.observations()["zoomed"]
    # a llama.cpp session adopting the torch session's memory (bench --shared-prefill) answers as one that read
    # the document itself, and the torch session's conversation is rolled back first
    adopted = Session(native.engine, native.document, native.settings, native.model_path)
    adopted.adopt(reference)
    assert adopted.document_tokens == native.document_tokens and not reference.turns
    assert [adopted.answer(q).text for q in (sample.questions[0].text,)] == answers[:1]
    with pytest.raises(SekvError, match="another document"):
        Session(native.engine, Document.from_text("other text"), native.settings, native.model_path).adopt(reference)


@pytest.mark.slow
def test_native_prefill_builds_the_memory_torch_builds_on_the_same_weights(f32_model, tokenizer, library) -> None:
    """The llama.cpp engine reads a 2K-token document natively (no torch forward pass for its chunks): the span
    table, anchors and answer are torch's, and the device peak, the chunks' compute buffers counted, stays
    within the budget."""
    load_library(library)
    sample = generate_sample("niah_single", 2000, seed=5, count_tokens=tokenizer.count, depth=0.4)
    from sekv_local.engines.llama_cpp_sekv import DECODE_ROOM

    # the llama.cpp engine's pins leave room for its decode room (answer_room): the torch side alike
    settings = SessionSettings(engine="torch", method="sekv", budget=0.25, threads=2, max_new_tokens=24,
                               method_options=(("answer_room", DECODE_ROOM),))
    sessions, torch_tokens = read_with_both_engines(f32_model, tokenizer, sample.document, settings)
    assert not torch_tokens  # the document's chunks never ran the torch model
    torch_cache, native_cache = sessions["torch"].engine.cache, sessions["llama.cpp"].engine.reference.cache
    for name in ("span_pos", "span_len", "exact_pos"):
        a, b = getattr(torch_cache, name).view(), getattr(native_cache, name).view()
        print(name, a.shape, b.shape)
        assert a.shape == b.shape and torch.equal(a, b), name
    np.testing.assert_allclose(native_cache.layers[5].sum_k.view().float(), torch_cache.layers[5].sum_k.view().float(),
                               atol=0.05, rtol=0.02)
    answers = [sessions[e].answer(sample.questions[0].text) for e in ("torch", "llama.cpp")]
    print([a.text for a in answers])
    assert answers[0].text == answers[1].text
    memory = sessions["llama.cpp"].engine.memory()
    assert memory.device_peak_bytes <= 0.25 * memory.full_kv_bytes
    assert 0 < sum(torch_tokens) < 100  # the question's chunk only (select=question's exact pass)


@pytest.mark.slow
def test_bench_shares_the_torch_prefill_with_the_llama_cpp_engine(tmp_path, library) -> None:
    out = tmp_path / "bench"
    proc = run_cli("bench", "--tasks", "niah_single", "--lengths", "1k", "--samples", "2", "--engine", "torch,llama.cpp",
                   "--method", "sekv", "--budgets", "0.5", "--threads", "2", "--shared-prefill", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads((out / "results.json").read_text())["records"]
    assert [(r["engine"], r["sample"]) for r in records] == [("torch", 0), ("llama.cpp", 0), ("torch", 1), ("llama.cpp", 1)]
    for torch_row, native_row in zip(records[::2], records[1::2]):
        assert "ingest_shared_from" not in torch_row and native_row["ingest_shared_from"] == "torch"
        # the llama.cpp engine prefilled only the question: the document came with the adopted memory
        assert native_row["prefill_tokens"] < 100 < torch_row["prefill_tokens"]
        assert native_row["n_tokens"] == torch_row["n_tokens"]
    refused = run_cli("bench", "--engine", "llama.cpp", "--method", "sekv", "--budgets", "0.5", "--shared-prefill",
                      "--out", str(tmp_path / "x"))
    assert refused.returncode != 0 and "--engine torch,llama.cpp" in refused.stderr


def test_llama_cpp_engine_refuses_other_methods(model_path, tokenizer) -> None:
    from sekv_local.engines.factory import create_engine

    with pytest.raises(SekvError, match="runs method 'sekv'"):
        create_engine("llama.cpp", model_path, tokenizer, EngineOptions(method="snapkv", budget=0.25))
    with pytest.raises(SekvError, match="router"):
        create_engine("llama.cpp", model_path, tokenizer,
                      EngineOptions(method="sekv", budget=0.25, method_options={"router": "bounds"}))


def test_library_is_not_loaded_twice(library) -> None:
    assert load_library(library) is load_library()
    assert isinstance(load_library(), ctypes.CDLL)


def run_cli(*args: str, timeout: int = 900):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "sekv_local", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.slow
def test_ask_with_the_llama_cpp_engine(tmp_path, library, model_path) -> None:
    import json

    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper of Port Alder is Maren Holt. The harbour has forty boats.\n" * 40)
    proc = run_cli("ask", str(doc), "Who is the lighthouse keeper of Port Alder?", "--json", "--engine", "llama.cpp",
                   "--method", "sekv", "--budget", "0.5", "--threads", "2", "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["engine"] == "llama.cpp" and "Maren" in out["answer"]
    assert 0 < out["memory"]["device_peak_bytes"] <= 0.5 * out["memory"]["full_kv_bytes"]
    bad = run_cli("ask", str(doc), "Who?", "--engine", "llama.cpp", "--method", "h2o", "--budget", "0.5")
    assert bad.returncode == 2 and "runs method 'sekv'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_speed_command_writes_side_by_side_numbers(tmp_path, library, model_path) -> None:
    import json

    out = tmp_path / "speed"
    proc = run_cli("speed", "--runs", "llama.cpp-stock:full,llama.cpp:sekv@zoom_k=4@read_budget=0.2", "--context", "1536",
                   "--new-tokens", "8", "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    runs = {r["run"]: r for r in data["results"]}
    sekv = runs["llama.cpp:sekv@zoom_k=4@read_budget=0.2"]
    assert set(runs) == {"llama.cpp-stock:full", sekv["run"]}
    for r in runs.values():
        assert r["median"]["prefill_tok_s"] > 0 and r["median"]["decode_tok_s"] > 0 and r["context_tokens"] == 1536
        assert all(len(values) == 1 for values in r["timings"].values())  # one value per repeat
    assert sekv["device_peak_bytes"] <= 0.25 * sekv["full_kv_bytes"]
    summary = (out / "summary.md").read_text()
    assert "first token s" in summary and "answer ratio" in summary and "total ratio" in summary
    for r in runs.values():  # the whole answer: every step, the first (the memory import) included
        m = r["median"]
        assert m["answer_s"] >= m["first_step_s"] + 6 / m["decode_tok_s"]
        assert m["ttft_s"] >= m["question_s"] + m["first_step_s"] - 1e-9
        # from the command to the last token: the model load and the document are in it too
        assert m["total_s"] >= m["load_s"] + 1024 / m["prefill_tok_s"] + m["ttft_s"] + m["answer_s"] - m["first_step_s"] - 1e-6
        assert m["load_s"] > 0 and m["second_ttft_s"] > 0 and m["second_answer_s"] > 0
    # stock llama.cpp has no host tier; the native SeKV step counts the span rows it zooms into, within the
    # read budget (at 1K tokens the default 5% is less than one span's rows in every layer: no routed slot)
    assert runs["llama.cpp-stock:full"]["reads_per_step_bytes"] == 0
    assert 0 < sekv["reads_per_step_bytes"] <= 0.2 * sekv["full_kv_bytes"] and "not counted" not in summary
    bad = run_cli("speed", "--runs", "torch", "--out", str(out))
    assert bad.returncode == 2 and "ENGINE:METHOD" in bad.stderr


def test_probe_shapes_a_memory_like_sekv() -> None:
    from sekv_local.native.probe import MemoryShape

    shape = MemoryShape(8192, zoom_k=16)
    assert shape.n_exact + shape.n_spans * shape.span_rows == 8192
    # sinks + recent + about anchor_fraction of the rest stay exact
    assert 4 + 128 <= shape.n_exact <= 4 + 128 + 0.05 * 8192 + 64
    with pytest.raises(SekvError, match="no room"):
        MemoryShape(100)


@pytest.mark.slow
def test_native_probe_times_stock_and_sekv_decode(library, tmp_path) -> None:
    from click.testing import CliRunner

    from sekv_local.cli import cli

    load_library(library)
    out = tmp_path / "probe"
    result = CliRunner().invoke(cli, ["native", "probe", "--contexts", "2k", "--new-tokens", "4", "--repeats", "1",
                                      "--threads", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    (row,) = data["results"]
    assert row["context_tokens"] == 2048
    assert row["stock_decode_tok_s"][0] > 0 and row["sekv_decode_tok_s"][0] > 0
    # the SeKV memory's device tier (exact rows, summaries, metadata) is a small part of full KV at 2K
    assert 0 < row["sekv_device_bytes"] < 0.5 * row["full_kv_bytes"]
    assert "| 2048 |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(library, tmp_path) -> None:
    """native/gpu_check.sh's Python half with --device cpu: the synthetic model loads in llama.cpp, the
    scheduler path matches the direct path on it, and the speed table is written."""
    from sekv_local.native import gpu_check

    out = tmp_path / "check"
    status = gpu_check.main(["--device", "cpu", "--contexts", "2k", "--new-tokens", "4", "--repeats", "1",
                             "--threads", "1", "--layers", "2", "--out", str(out)])
    assert status == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert len(report["parity"]) == 2 * gpu_check.PARITY_STEPS  # training-free router, then the learned one
    assert all(s["argmax"][0] == s["argmax"][1] and s["zoom_agreement"] == 1.0 for s in report["parity"])
    learned = [s for s in report["parity"] if s["router"] == "learned router"]
    filled = 2 * 3 * 16 * gpu_check.PARITY_STEPS  # layers x KV heads x zoom slots x steps
    assert 0 < sum(s["empty_slots"] for s in learned) < filled  # the thresholds leave some slots empty, not all
    assert report["speed"][0]["context_tokens"] == 2048 and report["speed"][0]["sekv_decode_tok_s"][0] > 0


def test_a_memory_without_spans_exports_as_rows(model_path, tokenizer) -> None:
    """A document short enough to stay whole in the exact rows (no span yet) imports with the default host
    form: the chat's first answer used to fail reshaping zero spans."""
    from sekv_local.native.memory_export import export_memory

    engine = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", threads=2))
    ids = tokenizer.encode("The keeper of the lighthouse at Port Alder is Maren Holt.")
    engine.reserve(len(ids))
    engine.feed(ids)
    assert engine.cache.span_len.length == 0
    exported = export_memory(engine.cache, decompress=True)
    assert exported.n_exact == len(ids) and len(exported.span_len) == 0
    assert exported.layers[0].keys.raw.shape[0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("decompress", [False, True])
def test_parity_with_a_q8_0_host_tier(decompress, f32_model, tokenizer, library) -> None:
    """host_quant=q8_0: both engines read the host tier from llama.cpp's q8_0 blocks. They quantize different
    rows (torch the pre-RoPE factors or rows, native its own tables: rotated raw keys, transposed values), so the
    two differ by the rounding of both, not bit for bit."""
    steps = decode_side_by_side(f32_model, tokenizer, library, {"energy": 0.9, "host_quant": "q8_0"},
                                decompress=decompress)
    for s in steps:  # measured: KL up to 7e-5 (f16 tables: 3e-6), every argmax the same
        assert s["argmax"][0] == s["argmax"][1]
        assert s["kl"] < 1e-3
    assert np.mean([s["zoom_agreement"] for s in steps]) >= 0.99
