"""Score-based eviction baselines (h2o, snapkv, pyramidkv, chunkkv) on a toy 2-layer config:
budgets that hold during prefill, the right tokens kept, exactness when nothing is evicted, rollback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sekv_local.cache import create_policy
from sekv_local.cache import chunkkv, h2o, pyramidkv, snapkv  # noqa: F401  (register the methods)
from sekv_local.cache.pyramidkv import pyramid_budgets
from sekv_local.errors import BudgetError, SekvError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope

torch.set_num_threads(1)

CFG = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                  vocab_size=50, context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_scale=1.0,
                  rope_interleaved=True)
METHODS = ["h2o", "snapkv", "pyramidkv", "chunkkv"]
H, KV, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim


def make_stream(n: int, seed: int = 0, cfg: ModelConfig = CFG) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random pre-RoPE q/k/v for n positions, per layer: ([H, n, D], [KV, n, D], [KV, n, D])."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(cfg.n_heads, n, cfg.head_dim, generator=gen),
             torch.randn(cfg.n_kv_heads, n, cfg.head_dim, generator=gen),
             torch.randn(cfg.n_kv_heads, n, cfg.head_dim, generator=gen)) for _ in range(cfg.n_layers)]


def feed(policy, stream, start: int, end: int, chunk: int, prefill: bool = True) -> torch.Tensor:
    """Feed positions [start, end) of `stream` in chunks; returns the last layer's outputs [H, end-start, D]."""
    outs = []
    for a in range(start, end, chunk):
        b = min(end, a + chunk)
        policy.begin_chunk(torch.arange(a, b), prefill)
        for layer, (q, k, v) in enumerate(stream):
            out = policy.attend(layer, q[:, a:b], k[:, a:b], v[:, a:b])
        policy.end_chunk(None, torch.zeros(b - a, dtype=torch.long))
        outs.append(out)
    return torch.cat(outs, dim=1)


def conversation(policy, stream, n_doc: int, n_question: int, n_answer: int) -> torch.Tensor:
    """Document (finish_prefill), then a question turn (finish_prefill) and decoded tokens."""
    feed(policy, stream, 0, n_doc, policy.max_chunk_tokens())
    policy.finish_prefill()
    outs = [feed(policy, stream, n_doc, n_doc + n_question, policy.max_chunk_tokens())]
    policy.finish_prefill()
    outs.append(feed(policy, stream, n_doc + n_question, n_doc + n_question + n_answer, 1, prefill=False))
    return torch.cat(outs, dim=1)


def kept_positions(policy, layer: int) -> torch.Tensor:
    return policy.layers[layer].positions()


def state(policy) -> list[torch.Tensor]:
    out = []
    for store in policy.layers:
        out += [store.keys().clone(), store.values().clone(), store.positions().clone(), store.scores().clone()]
    for name in ("win_q", "win_pos"):
        out += [t.clone() for t in getattr(policy, name, [])]
    return out


# -- budgets -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@torch.inference_mode()
def test_device_tier_stays_within_budget_in_prefill_question_and_decode(method: str) -> None:
    n = 3000
    policy = create_policy(method, CFG, Rope(CFG), budget=0.25)
    policy.reserve(n)
    stream = make_stream(n + 100)
    conversation(policy, stream, n, 40, 20)
    report = policy.memory()
    limit = 0.25 * CFG.full_kv_bytes(n)
    assert report.device_peak_bytes <= limit, (report.device_peak_bytes, limit)
    assert report.device_bytes >= 0.95 * limit  # the budget is really used (tensors sized by it)
    for layer, store in enumerate(policy.layers):
        assert store.k.shape[1] == store.capacity < n  # real storage sized by the budget, not a mask
        assert 0 < store.length <= store.capacity
        pos = kept_positions(policy, layer)
        assert bool((pos[:, 1:] > pos[:, :-1]).all())  # slots stay in position order
        assert int(pos.max()) == n + 59  # the newest token is there


@pytest.mark.parametrize("method", METHODS)
def test_too_small_budget_is_refused(method: str) -> None:
    with pytest.raises(BudgetError, match="Raise --budget"):
        create_policy(method, CFG, Rope(CFG), budget=0.005).reserve(1000)


# -- what is kept ----------------------------------------------------------------------------------
def aligned_stream(n: int, important: int, strength: float) -> list:
    """Queries all share a component along the slowest-rotating RoPE pair; key `important` carries
    a large component along it (strength 0 = an ordinary key). Every other key is small noise."""
    stream = make_stream(n, seed=3)
    out = []
    for q, k, v in stream:
        q, k = q * 0.3, k * 0.5
        q[:, :, D - 2] = 4.0
        k[:, important, D - 2] = strength
        out.append((q, k, v))
    return out


@pytest.mark.parametrize("method", METHODS)
@torch.inference_mode()
def test_key_aligned_with_every_query_is_kept_and_others_are_evicted(method: str) -> None:
    n, important = 1200, 305
    for strength, should_keep in ((8.0, True), (0.0, False)):
        policy = create_policy(method, CFG, Rope(CFG), budget=0.25)
        policy.reserve(n)
        feed(policy, aligned_stream(n, important, strength), 0, n, policy.max_chunk_tokens())
        policy.finish_prefill()
        kept = []
        for layer in range(CFG.n_layers):
            pos = kept_positions(policy, layer)
            kept += (pos == important).any(dim=1).tolist()
            old = pos[pos < n - policy.layers[layer].capacity]
            assert old.numel() / pos.shape[0] < 0.5 * (n - policy.layers[layer].capacity)  # most old keys left
        # aligned: every layer and KV head keeps it; ordinary: it is not kept everywhere for free
        assert all(kept) == should_keep, (method, strength, kept)


@torch.inference_mode()
def test_h2o_scores_are_the_accumulated_attention_of_every_query() -> None:
    n = 300
    rope = Rope(CFG)
    policy = create_policy("h2o", CFG, rope, budget=10 ** 7, dtype="f32")
    stream = make_stream(n)
    feed(policy, stream, 0, n, 70)
    pos = torch.arange(n)
    for layer, (q, k, v) in enumerate(stream):
        qr, kr = rope.apply(q, pos), rope.apply(k, pos).repeat_interleave(CFG.group_size, 0)
        logits = (qr @ kr.transpose(1, 2)) / D ** 0.5
        probs = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        expected = probs.sum(1).view(KV, CFG.group_size, n).sum(1)
        torch.testing.assert_close(policy.layers[layer].scores(), expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_h2o_scores_keep_evolving_during_decode() -> None:
    n = 1500
    rope = Rope(CFG)
    policy = create_policy("h2o", CFG, rope, budget=0.25)
    policy.reserve(n)
    stream = make_stream(n)
    feed(policy, stream, 0, n, policy.max_chunk_tokens())
    store = policy.layers[0]
    assert store.length == store.capacity
    # one decode step: the lowest-score non-recent token per KV head leaves with its score, the new
    # token enters, and every kept key gains the attention it received (group_size per KV head in all)
    before = store.scores().clone()
    before_pos = store.positions().clone()
    protected = before_pos >= n - (policy.recent - 1)
    evicted = torch.where(protected, float("inf"), before).min(dim=1)
    feed(policy, make_stream(n + 1, seed=9), n, n + 1, 1, prefill=False)
    after_pos = store.positions()
    for row in range(KV):
        assert int(before_pos[row, evicted.indices[row]]) not in after_pos[row].tolist()
        assert int(after_pos[row, -1]) == n
    torch.testing.assert_close(store.scores().sum(1), before.sum(1) - evicted.values + CFG.group_size)
    survivors = after_pos[:, :-1]
    prev = torch.stack([before[r][torch.searchsorted(before_pos[r], survivors[r])] for r in range(KV)])
    assert bool((store.scores()[:, :-1] > prev).all())  # every kept key received some attention
    # decode queries that look at one weak heavy hitter of KV head 0 make it the heaviest
    heavy = ~(after_pos >= n + 1 - policy.recent)
    order = torch.where(heavy[0], store.scores()[0], float("inf")).argsort()
    slot = int(order[int(heavy[0].sum()) // 2])  # a middling heavy hitter
    target = int(after_pos[0, slot])
    key = store.k[0, slot].float()
    for step in range(n + 1, n + 41):
        q = torch.randn(H, 1, D)
        q[: CFG.group_size, 0] = 3 * rope.apply(key[None], torch.tensor([-step]))[0]  # post-RoPE q = 3 * key
        policy.begin_chunk(torch.tensor([step]), False)
        for layer in range(CFG.n_layers):
            policy.attend(layer, q, torch.randn(KV, 1, D), torch.randn(KV, 1, D))
        policy.end_chunk(None, torch.zeros(1, dtype=torch.long))
    pos0 = store.positions()[0]
    assert target in pos0.tolist()
    assert int(pos0[store.scores()[0].argmax()]) == target


@torch.inference_mode()
def test_snapkv_scores_are_the_windows_pooled_attention() -> None:
    n, w = 300, 32
    rope = Rope(CFG)
    policy = create_policy("snapkv", CFG, rope, budget=10 ** 7, dtype="f32", window=w)
    stream = make_stream(n)
    feed(policy, stream, 0, n - 10, 70)
    feed(policy, stream, n - 10, n, 10)  # the true window spans two chunks
    policy.finish_prefill()
    pos = torch.arange(n)
    for layer, (q, k, v) in enumerate(stream):
        qr, kr = rope.apply(q, pos)[:, -w:], rope.apply(k, pos).repeat_interleave(CFG.group_size, 0)
        logits = (qr @ kr.transpose(1, 2)) / D ** 0.5
        future = pos[None, :] > pos[-w:, None]
        votes = logits.masked_fill(future, float("-inf")).softmax(-1).sum(1)
        votes = votes.view(KV, CFG.group_size, n).mean(1)
        expected = F.avg_pool1d(votes[:, None], 5, stride=1, padding=2)[:, 0]
        torch.testing.assert_close(policy.layers[layer].scores(), expected, atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_snapkv_keeps_different_tokens_per_head_plus_the_window() -> None:
    n = 1500
    policy = create_policy("snapkv", CFG, Rope(CFG), budget=0.25)
    policy.reserve(n)
    feed(policy, make_stream(n), 0, n, policy.max_chunk_tokens())
    policy.finish_prefill()
    for layer in range(CFG.n_layers):
        pos = kept_positions(policy, layer)
        assert pos.shape[0] == KV and not torch.equal(pos[0], pos[1])
        for row in pos:
            assert set(range(n - 32, n)) <= set(row.tolist())


@torch.inference_mode()
def test_snapkv_question_agnostic_freezes_and_question_aware_reranks() -> None:
    n_doc, n_q = 1000, 40
    rope = Rope(CFG)
    stream = make_stream(n_doc + n_q, seed=5)
    ranks = {}
    for aware in (False, True):
        policy = create_policy("snapkv", CFG, rope, budget=0.3, question_aware=aware, pool_kernel=1)
        policy.reserve(n_doc)
        feed(policy, stream, 0, n_doc, policy.max_chunk_tokens())
        policy.finish_prefill()
        store = policy.layers[0]
        assert store.length == store.capacity
        doc_pos, doc_scores = store.positions().clone(), store.scores().clone()
        # the question (KV head 0's queries) looks at a document token of middling rank
        older = doc_pos[0] < n_doc - 32
        slot = int(torch.where(older, doc_scores[0], float("inf")).argsort()[int(older.sum()) // 2])
        target, key = int(doc_pos[0, slot]), store.k[0, slot].float()
        q_stream = [(q.clone(), k, v) for q, k, v in stream]
        for q, _, _ in q_stream:
            for step in range(n_doc, n_doc + n_q):
                q[: CFG.group_size, step] = 3 * rope.apply(key[None], torch.tensor([-step]))[0]  # post-RoPE 3*key
        feed(policy, q_stream, n_doc, n_doc + n_q, n_q)
        policy.finish_prefill()
        pos, scores = store.positions(), store.scores()
        is_doc = pos < n_doc
        assert target in pos[0].tolist() and int((~is_doc).sum(1).min()) == n_q
        if not aware:
            for row in range(KV):  # the document's ranking is frozen; question tokens are not scored
                kept = pos[row][is_doc[row]]
                old = doc_scores[row][torch.searchsorted(doc_pos[row], kept)]
                assert torch.equal(scores[row][is_doc[row]], old)
            assert bool((scores[~is_doc] == -1).all())
        else:
            assert bool((scores >= 0).all())
        doc0 = torch.where(is_doc[0], scores[0], float("-inf"))
        ranks[aware] = int((doc0 > scores[0, int((pos[0] == target).nonzero())]).sum())
    assert ranks[True] == 0 < ranks[False]  # the question's window re-ranked the document only when aware


def test_pyramid_budgets_fall_linearly_and_sum_to_snapkv() -> None:
    budgets = pyramid_budgets(1000, 32, 20.0)
    assert sum(budgets) == 32 * 1000
    assert all(a >= b for a, b in zip(budgets, budgets[1:])) and budgets[0] > budgets[-1]
    assert abs(budgets[-1] - 1000 / 20) <= 1 and abs(budgets[0] - (2000 - 50)) <= 1
    assert pyramid_budgets(700, 1, 20.0) == [700]


@torch.inference_mode()
def test_pyramidkv_layers_shrink_bottom_to_top_at_snapkv_bytes() -> None:
    cfg = dataclasses.replace(CFG, n_layers=4)
    n = 2000
    snap = create_policy("snapkv", cfg, Rope(cfg), budget=0.25)
    pyr = create_policy("pyramidkv", cfg, Rope(cfg), budget=0.25)
    snap.reserve(n)
    pyr.reserve(n)
    caps = [store.capacity for store in pyr.layers]
    assert all(a > b for a, b in zip(caps, caps[1:]))
    assert sum(caps) == sum(store.capacity for store in snap.layers) == cfg.n_layers * snap.capacity
    w = pyr.cfg.window
    assert abs(caps[-1] - w - (snap.capacity - w) / 20) <= 1
    stream = make_stream(n, cfg=cfg)
    for policy in (snap, pyr):
        feed(policy, stream, 0, n, policy.max_chunk_tokens())
        policy.finish_prefill()
    rs, rp = snap.memory(), pyr.memory()
    assert rs.device_bytes == rp.device_bytes and rs.device_peak_bytes == rp.device_peak_bytes
    assert rp.device_peak_bytes <= 0.25 * cfg.full_kv_bytes(n)
    per_layer = rp.device_per_layer
    assert all(a > b for a, b in zip(per_layer, per_layer[1:]))
    assert [store.length for store in pyr.layers] == caps  # every layer is full after the document


@torch.inference_mode()
def test_chunkkv_keeps_whole_chunks_with_the_same_tokens_in_every_head() -> None:
    n, size, w = 1500, 10, 32
    rope = Rope(CFG)
    policy = create_policy("chunkkv", CFG, rope, budget=0.25, dtype="f32")
    policy.reserve(n)
    stream = make_stream(n)
    feed(policy, stream, 0, n, policy.max_chunk_tokens())
    policy.finish_prefill()
    for layer, (q, k, v) in enumerate(stream):
        store = policy.layers[layer]
        pos = store.positions()
        assert pos.shape[0] == 1  # one row of positions for all heads
        ids, counts = torch.unique(pos[0] // size, return_counts=True)
        old = (ids + 1) * size - 1 < n - w
        assert bool((counts[old] == size).all())  # whole chunks, outside the window
        assert len(ids) < n // size  # chunks were evicted
        # every head holds exactly these tokens
        expected_k = rope.apply(k, torch.arange(n))[:, pos[0].long()]
        torch.testing.assert_close(store.keys(), expected_k)
        torch.testing.assert_close(store.values(), v[:, pos[0].long()])


# -- exactness and rollback --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@torch.inference_mode()
def test_equals_full_kv_when_the_budget_exceeds_the_context(method: str) -> None:
    rope = Rope(CFG)
    stream = make_stream(560)
    full = create_policy("full", CFG, rope, dtype="f32")
    policy = create_policy(method, CFG, rope, budget=10 ** 7, dtype="f32")
    policy.reserve(560)
    for p in (full, policy):
        p.outputs = [feed(p, stream, 0, 500, 100)]
        p.finish_prefill()
        p.outputs.append(feed(p, stream, 500, 540, 40))
        p.finish_prefill()
        p.outputs.append(feed(p, stream, 540, 560, 1, prefill=False))
    for a, b in zip(full.outputs, policy.outputs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert all(store.length == 560 for store in policy.layers)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("aware", [False, True])
@torch.inference_mode()
def test_rollback_restores_the_document_state(method: str, aware: bool) -> None:
    if method == "h2o" and aware:
        pytest.skip("h2o has no question-aware switch")
    options = {"question_aware": True} if aware else {}
    n = 800
    policy = create_policy(method, CFG, Rope(CFG), budget=0.3, **options)
    policy.reserve(n)
    stream = make_stream(n + 200)
    feed(policy, stream, 0, n, policy.max_chunk_tokens())
    policy.finish_prefill()
    mark = policy.mark()
    saved, tokens = state(policy), policy.n_tokens
    for seed in (1, 2):
        turn = make_stream(n + 200, seed=seed)
        feed(policy, turn, n, n + 60, policy.max_chunk_tokens())
        policy.finish_prefill()
        answer = feed(policy, turn, n + 60, n + 100, 1, prefill=False)
        assert any(not torch.equal(a, b) for a, b in zip(saved, state(policy)))
        policy.rollback(mark)
        assert policy.n_tokens == tokens
        for a, b in zip(saved, state(policy)):
            assert torch.equal(a, b)
        feed(policy, turn, n, n + 60, policy.max_chunk_tokens())
        policy.finish_prefill()
        again = feed(policy, turn, n + 60, n + 100, 1, prefill=False)
        assert torch.equal(answer, again)  # the same question after a rollback gives the same answer
        policy.rollback(mark)


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("h2o", {"recent_fraction": 1.0}),
    ("h2o", {"recent_fraction": -0.1}),
    ("h2o", {"chunk_fraction": 0.0}),
    ("h2o", {"dtype": "q4"}),
    ("h2o", {"window": 32}),
    ("h2o", {"chunk_fraction": "abc"}),
    ("snapkv", {"window": 32.0}),
    ("snapkv", {"window": 0}),
    ("snapkv", {"pool_kernel": 4}),
    ("snapkv", {"pool": "median"}),
    ("snapkv", {"question_aware": "yes"}),
    ("snapkv", {"chunk_fraction": 1.0}),
    ("snapkv", {"beta": 20}),
    ("pyramidkv", {"beta": 0.5}),
    ("pyramidkv", {"window": -1}),
    ("chunkkv", {"chunk_size": 0}),
    ("chunkkv", {"pool_kernel": 0}),
])
def test_invalid_options_are_refused(method: str, options: dict) -> None:
    with pytest.raises(SekvError, match=method):
        create_policy(method, CFG, Rope(CFG), budget=0.25, **options)


@pytest.mark.parametrize("method", METHODS)
def test_a_budget_is_required(method: str) -> None:
    with pytest.raises(SekvError, match="needs a --budget"):
        create_policy(method, CFG, Rope(CFG))


def test_paper_defaults() -> None:
    assert h2o.H2OConfig().recent_fraction == 0.5
    cfg = snapkv.SnapKVConfig()
    assert (cfg.window, cfg.pool_kernel, cfg.pool, cfg.question_aware) == (32, 5, "avg", False)
    assert pyramidkv.PyramidKVConfig().beta == 20.0
    assert chunkkv.ChunkKVConfig().chunk_size == 10


def test_pyramid_budgets_capped_at_the_planned_length_keep_their_sum() -> None:
    from sekv_local.cache.pyramidkv import cap_budgets

    budgets = pyramid_budgets(800, 30, 20.0)  # bottom layers ask for ~2x the 870 tokens there are
    capped = cap_budgets(budgets, 870)
    assert max(capped) == 870
    assert sum(capped) == sum(budgets)  # the excess goes to the top layers, not lost
    assert capped == sorted(capped, reverse=True)  # still a pyramid
    assert capped[-1] > budgets[-1]
    assert cap_budgets([5, 5], 3) == [3, 3]  # every layer at the cap: the rest cannot be used
