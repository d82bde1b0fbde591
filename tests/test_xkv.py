"""xKV: the rank formula, the incremental cross-layer SVD, and the real model within its budget."""

from __future__ import annotations

import pytest
import torch

from sekv_local.cache.xkv import XkvConfig, _WindowFactors, derive_ranks
from sekv_local.documents import Document
from sekv_local.errors import BudgetError, SekvError
from sekv_local.eval.tasks import generate_sample
from sekv_local.session import Session, SessionSettings


def test_derive_ranks_is_the_largest_rank_sum_that_fits() -> None:
    tokens, layers, kv_dim, size = 7000, 30, 192, 2
    for group in (1, 2, 4):
        budget = 20 * 2**20
        r_k, r_v = derive_ranks(budget, tokens, layers, group, kv_dim, size, v_share=0.6)
        windows = -(-layers // group)
        per_rank = size * (windows * tokens + layers * kv_dim)
        assert (r_k + r_v) * per_rank <= budget < (r_k + r_v + 1) * per_rank
        assert r_v == round(0.6 * (r_k + r_v))
    # long contexts: compression of the factors alone is 2 * G * kv_dim / (r_k + r_v)
    r_k, r_v = derive_ranks(10**12, 10**7, layers, 4, kv_dim, size, 0.6)
    assert r_k + r_v == 2 * 4 * kv_dim  # capped at full rank
    full = layers * 10**7 * 2 * kv_dim * size
    r_k, r_v = derive_ranks(full // 8, 10**7, layers, 2, kv_dim, size, 0.6)  # 30 layers = 15 whole windows
    assert 2 * 2 * kv_dim / (r_k + r_v) == pytest.approx(8, rel=0.02)


def test_config_is_validated() -> None:
    with pytest.raises(SekvError, match="group"):
        XkvConfig(group=0)
    with pytest.raises(SekvError, match="rank"):
        XkvConfig(rank_k=8)
    with pytest.raises(SekvError, match="reconstruct"):
        XkvConfig(reconstruct="sometimes")


def _absorb_in_chunks(x: torch.Tensor, rank: int, chunk: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    f = _WindowFactors(rank, x.shape[1], dtype, torch.device("cpu"))
    for start in range(0, x.shape[0], chunk):
        f.absorb(x[start: start + chunk])
    return f.a.view()[0].float() @ f.b.float()


def test_incremental_svd_is_exact_for_a_low_rank_input() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 12, generator=g) @ torch.randn(12, 384, generator=g)  # rank 12
    rebuilt = _absorb_in_chunks(x, rank=16, chunk=128)
    assert torch.linalg.norm(rebuilt - x) / torch.linalg.norm(x) < 1e-4
    rebuilt16 = _absorb_in_chunks(x, rank=16, chunk=128, dtype=torch.float16)
    assert torch.linalg.norm(rebuilt16 - x) / torch.linalg.norm(x) < 5e-3  # f16 storage rounding only


def test_incremental_svd_error_stays_near_the_best_truncation() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(800, 24, generator=g) @ torch.randn(24, 256, generator=g) + 0.05 * torch.randn(800, 256, generator=g)
    rank = 24
    s = torch.linalg.svdvals(x)
    best = torch.sqrt((s[rank:] ** 2).sum())  # Eckart-Young: the error of the optimal rank-24 factorization
    err = torch.linalg.norm(_absorb_in_chunks(x, rank=rank, chunk=100) - x)
    assert 0.999 * best <= err <= 1.5 * best


def test_incremental_svd_follows_a_subspace_that_appears_late() -> None:
    # the first chunks span one subspace, later chunks another: the basis must take the new one in
    g = torch.Generator().manual_seed(2)
    early = torch.randn(300, 8, generator=g) @ torch.randn(8, 192, generator=g)
    late = torch.randn(300, 8, generator=g) @ torch.randn(8, 192, generator=g)
    x = torch.cat([early, late])
    rebuilt = _absorb_in_chunks(x, rank=16, chunk=64)
    assert torch.linalg.norm(rebuilt - x) / torch.linalg.norm(x) < 1e-4
    frozen = _absorb_in_chunks(x, rank=8, chunk=64)  # too small a rank cannot hold both
    assert torch.linalg.norm(frozen - x) / torch.linalg.norm(x) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("group,budget", [(1, 0.25), (4, 0.25)])
def test_xkv_stays_within_its_device_budget_on_the_real_model(tokenizer, group: int, budget: float) -> None:
    sample = generate_sample("niah_single", 3000, seed=4242, count_tokens=tokenizer.count, depth=0.4)
    session = Session.create(Document.from_text(sample.document),
                             SessionSettings(method="xkv", budget=budget, threads=2, max_new_tokens=12,
                                             method_options=(("group", group),)),
                             show_progress=False, tokenizer=tokenizer)
    session.ingest()
    memory = session.engine.memory()
    budget_bytes = budget * session.engine.config.full_kv_bytes(memory.tokens)
    assert memory.device_peak_bytes <= budget_bytes
    policy = session.engine.cache
    assert policy.comp_pos.length > 2500  # the document went into the factors, not into exact rows
    compressed_after_document = policy.comp_pos.length
    answer = session.answer(sample.questions[0].text)
    assert answer.n_tokens >= 1
    assert answer.memory["device_peak_bytes"] <= budget_bytes
    # rollback to the document restores the factors the question's compression has rotated
    assert policy.comp_pos.length > compressed_after_document
    session.reset_conversation()
    again = session.answer(sample.questions[0].text)
    assert again.text == answer.text


def test_xkv_refuses_a_budget_without_room_for_factors(tokenizer) -> None:
    sample = generate_sample("niah_single", 1000, seed=1, count_tokens=tokenizer.count, depth=0.5)
    session = Session.create(Document.from_text(sample.document),
                             SessionSettings(method="xkv", budget=0.02, threads=1), show_progress=False,
                             tokenizer=tokenizer)
    with pytest.raises(BudgetError, match="at least"):
        session.ingest()


def test_saved_state_continues_exactly_like_the_original() -> None:
    from sekv_local.cache import create_policy
    from sekv_local.models.config import ModelConfig
    from sekv_local.models.rope import Rope

    cfg = ModelConfig(architecture="llama", n_layers=4, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=50, context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=16,
                      rope_scale=1.0, rope_interleaved=True)
    rope = Rope(cfg)

    def feed(policy, start: int, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        policy.begin_chunk(torch.arange(start, start + n), n > 1)
        for layer in range(cfg.n_layers):
            out = policy.attend(layer, torch.randn(4, n, 16, generator=g), torch.randn(2, n, 16, generator=g),
                                torch.randn(2, n, 16, generator=g))
        policy.end_chunk(None, torch.zeros(n, dtype=torch.long))
        return out

    def make():
        policy = create_policy("xkv", cfg, rope, budget=10 ** 7, group=2, rank_k=8, rank_v=12, outlier_fraction=0.05)
        policy.reserve(700)
        return policy

    original = make()
    with torch.inference_mode():
        for start in range(0, 600, 128):
            feed(original, start, min(128, 600 - start), start)
        tensors, meta = original.export_state()
        copy = make()
        copy.import_state({k: v.clone() for k, v in tensors.items()}, meta)
        assert copy.comp_pos.length == original.comp_pos.length > 500
        assert copy.layers[1].out_k.length > 0  # outlier chunks travel too
        for step in range(80):  # decode past the next compression
            torch.testing.assert_close(feed(copy, 600 + step, 1, step), feed(original, 600 + step, 1, step))
        wrong = create_policy("xkv", cfg, rope, budget=10 ** 7, group=2, rank_k=4, rank_v=4)
        with pytest.raises(ValueError, match="ranks"):
            wrong.import_state(tensors, meta)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4])
def test_xkv_with_room_for_high_ranks_finds_the_needle_full_kv_finds(tokenizer, group: int) -> None:
    sample = generate_sample("niah_single", 1500, seed=31, count_tokens=tokenizer.count, depth=0.5)
    question, expected = sample.questions[0].text, sample.questions[0].answers[0]

    def ask(method: str, budget: float | None) -> str:
        session = Session.create(Document.from_text(sample.document),
                                 SessionSettings(method=method, budget=budget, threads=2, max_new_tokens=24,
                                                 method_options=(("group", group),) if method == "xkv" else ()),
                                 show_progress=False, tokenizer=tokenizer)
        session.ingest()
        if method == "xkv":  # the needle really went through the factors, not exact rows
            assert session.engine.cache.comp_pos.length > 1000
        return session.answer(question).text

    assert expected in ask("full", None)  # the model can answer this one: the test measures the compression
    assert expected in ask("xkv", 0.95)
