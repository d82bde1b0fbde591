"""SeKV mechanics: exactness when nothing is lost, budget accounting, rollback, refusal."""

from __future__ import annotations

import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.errors import BudgetError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope
from sekv_local.sekv.factors import FactorStore
from sekv_local.sekv.segmentation import RunningStats, segment

CFG = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                  vocab_size=50, context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_scale=1.0,
                  rope_interleaved=True)


def run(policy, n_tokens: int, chunk: int, seed: int = 0) -> list[torch.Tensor]:
    """Feed random pre-RoPE q/k/v (same stream for any policy) and return the layer-1 outputs."""
    outs = []
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for start in range(0, n_tokens, chunk):
            T = min(chunk, n_tokens - start)
            policy.begin_chunk(torch.arange(start, start + T), True)
            for layer in range(CFG.n_layers):
                q = torch.randn(4, T, 16, generator=gen)
                k = torch.randn(2, T, 16, generator=gen)
                v = torch.randn(2, T, 16, generator=gen)
                out = policy.attend(layer, q, k, v)
            policy.end_chunk(torch.randn(T, 50, generator=gen) * 3, torch.randint(0, 50, (T,), generator=gen))
            outs.append(out)
    return outs


@pytest.mark.parametrize("method", ["sekv", "sekv+xkv"])
def test_mixed_attention_is_exact_when_every_span_is_rebuilt_at_full_rank(method: str) -> None:
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    sekv = create_policy(method, CFG, rope, budget=10 ** 9, zoom_k=200, energy=1.0, max_rank=64, dtype="f32",
                         recent=16, l_min=4, l_max=8, anchor_fraction=0.2, n_sink=2)
    sekv.reserve(600)
    expected, got = run(full, 600, 64), run(sekv, 600, 64)
    assert sekv.span_len.length > 50 and sekv.exact_pos.length > 2  # spans and anchors really exist
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_coarse_rows_stand_in_for_unexpanded_spans() -> None:
    """With zoom off, a span of identical keys/values is represented exactly by its summary with
    +log|S|: the softmax mass of |S| equal logits is |S| * exp(logit)."""
    rope = Rope(CFG)
    sekv = create_policy("sekv", CFG, rope, budget=10 ** 9, zoom_k=0, dtype="f32", recent=8, l_min=4, l_max=8, n_sink=0,
                         anchor_fraction=0.0)
    assert sekv.zoom_pool_bytes() == 0
    out = run(sekv, 200, 50)
    assert all(torch.isfinite(o).all() for o in out) and sekv.span_len.length > 0


def test_device_tier_stays_within_budget_during_prefill_and_decode() -> None:
    rope = Rope(CFG)
    n = 3000
    sekv = create_policy("sekv", CFG, rope, budget=0.3, l_min=4, l_max=32, recent=32, zoom_k=4)
    sekv.reserve(n)
    run(sekv, n, sekv.max_chunk_tokens())
    with torch.inference_mode():
        sekv.begin_chunk(torch.arange(n, n + 1), False)  # a decode step rebuilds zoomed spans
        for layer in range(CFG.n_layers):
            sekv.attend(layer, torch.randn(4, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))
        sekv.end_chunk(torch.randn(1, 50), torch.tensor([3]))
    report = sekv.memory()
    limit = 0.3 * CFG.full_kv_bytes(n)
    assert report.device_peak_bytes <= limit, (report.device_peak_bytes, limit)
    assert report.device_peak_bytes > report.device_bytes  # the zoom working set was counted
    assert report.host_bytes > 0 and report.device_bytes < limit


def decode_step(policy, position: int) -> None:
    with torch.inference_mode():
        policy.begin_chunk(torch.arange(position, position + 1), False)
        for layer in range(CFG.n_layers):
            policy.attend(layer, torch.randn(4, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))
        policy.end_chunk(torch.randn(1, 50), torch.tensor([3]))


@pytest.mark.parametrize("pool", ["fixed", "free"])
def test_a_free_pool_takes_the_prefill_chunks_room_at_decode_within_the_budget(pool: str) -> None:
    """After the document, pool=free gives the prefill chunk's room to the zoom pool: more spans rebuilt per
    decode step than planned, the measured device peak still within the budget; fixed keeps the plan."""
    rope = Rope(CFG)
    n = 3000
    sekv = create_policy("sekv", CFG, rope, budget=0.3, l_min=4, l_max=32, recent=32, pool=pool, select="step")
    sekv.reserve(n)
    run(sekv, n, sekv.max_chunk_tokens())
    planned, spans = sekv.zoom_k, sekv.span_len.length
    assert planned < spans  # the plan cannot zoom every span: room matters
    held_before = sekv.memory().device_bytes
    sekv.finish_prefill()
    decode_step(sekv, n)
    limit = 0.3 * CFG.full_kv_bytes(n)
    report = sekv.memory()
    assert report.device_peak_bytes <= limit, (report.device_peak_bytes, limit)
    if pool == "fixed":
        assert sekv._step_zoom_k == planned and report.device_bytes == held_before
    else:
        assert planned < sekv._step_zoom_k <= spans  # the chunk's room went to the pool
        assert report.device_bytes < held_before  # the pending buffers gave it back
        chosen = sekv._zoom_events[-1][1]
        assert chosen.shape[-1] == sekv._step_zoom_k and (chosen >= 0).all()
        # the step's rebuilt rows (float32 K and V) fill what the tensors left of the budget
        assert limit - report.device_peak_bytes < sekv.zoom_pool_bytes(1) + sekv.token_bytes * 16 + 64


def test_raw_spans_are_zoomed_at_the_cache_dtype_twice_the_pool_in_the_same_bytes() -> None:
    """rank_rule=exact rebuilds rows exactly as the host stores them (f16): attention is the same as from
    float32 copies of those rows, one span costs half the device bytes, so the planned pool doubles and the
    measured peak stays within the budget. Factored spans keep float32 products."""
    rope = Rope(CFG)
    n, limit = 3000, 0.3 * CFG.full_kv_bytes(3000)
    plans = {}
    for rule in ("span", "exact"):
        sekv = create_policy("sekv", CFG, rope, budget=0.3, l_min=4, l_max=32, recent=32, rank_rule=rule,
                             select="step")
        sekv.reserve(n)
        plans[rule] = sekv
    span, exact = plans["span"], plans["exact"]
    assert (span.zoom_dtype, exact.zoom_dtype) == (torch.float32, torch.float16)
    assert 2 * exact.zoom_pool_bytes(1) == span.zoom_pool_bytes(1)
    assert exact.zoom_k >= 2 * span.zoom_k - 1 and span.zoom_k >= 8
    run(exact, n, exact.max_chunk_tokens())
    decode_step(exact, n)
    assert exact._zoom_events[-1][1].shape[-1] == exact.zoom_k < exact.span_len.length
    assert exact.memory().device_peak_bytes <= limit

    class Float32Rows(type(exact)):
        zoom_dtype = torch.float32  # the old behaviour: float32 copies of the same rows

    outputs = []
    for cls in (type(exact), Float32Rows):
        sekv = cls(CFG, rope, budget=10 ** 7, zoom_k=4, l_min=4, l_max=16, recent=16, rank_rule="exact")
        outputs.append(run(sekv, 600, 100))
        assert sekv._zoom_events and sekv.span_len.length > 4
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def test_pool_free_is_only_for_the_auto_sized_pool() -> None:
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=0.3, zoom_k=4, pool="free")
    assert not sekv.free_pool  # an explicit zoom_k is the user's pool size at every step
    with pytest.raises(Exception, match="pool must be one of"):
        create_policy("sekv", CFG, Rope(CFG), budget=0.3, pool="huge")


def test_rollback_restores_the_document_state() -> None:
    rope = Rope(CFG)
    sekv = create_policy("sekv", CFG, rope, budget=10 ** 7, l_min=4, l_max=16, recent=16, zoom_k=4)
    sekv.reserve(400)
    run(sekv, 400, 100)
    mark = sekv.mark()
    before = (sekv.span_len.length, sekv.exact_pos.length, sekv.pend_pos.length, sekv.memory().host_bytes)
    run(sekv, 300, 60, seed=1)  # a "conversation" that gets folded into spans
    assert sekv.span_len.length > before[0]
    with torch.inference_mode():
        sekv.rollback(mark)
    assert (sekv.span_len.length, sekv.exact_pos.length, sekv.pend_pos.length) == before[:3]
    assert sekv.layers[0].fac_k.n_spans == before[0]


def test_impossible_budget_is_refused_with_numbers() -> None:
    with pytest.raises(BudgetError, match="cannot hold even the minimum.*Use a budget of at least"):
        create_policy("sekv", CFG, Rope(CFG), budget=0.01).reserve(4000)


def test_no_budget_given_takes_the_least_that_holds_a_short_document() -> None:
    """The default (25%) grows to the minimum plan for a short document instead of refusing it; a budget the
    user gives is refused as before."""
    with pytest.raises(BudgetError):
        create_policy("sekv", CFG, Rope(CFG), budget=0.25).reserve(60)
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=None)
    sekv.reserve(60)
    full = CFG.full_kv_bytes(60)
    assert sekv.budget_bytes > 0.25 * full and not sekv.budget_given
    roomy = create_policy("sekv", CFG, Rope(CFG), budget=None)
    roomy.reserve(8000)  # long enough for 25%: the default is 25%
    assert roomy.budget_bytes == int(0.25 * CFG.full_kv_bytes(8000))


def test_tight_budget_shrinks_the_zoom_pool_and_still_holds_the_budget() -> None:
    rope = Rope(CFG)
    n = 2000
    roomy = create_policy("sekv", CFG, rope, budget=1.0, zoom_k=16, routing_dim=8)
    roomy.reserve(n)
    assert roomy.zoom_k == 16
    tight = create_policy("sekv", CFG, rope, budget=0.45, zoom_k=16, routing_dim=8)
    tight.reserve(n)  # fits only with a smaller zoom pool (same planner, no refusal)
    assert 1 <= tight.zoom_k < 16
    run(tight, n, tight.max_chunk_tokens())
    with torch.inference_mode():
        tight.begin_chunk(torch.arange(n, n + 1), False)
        for layer in range(CFG.n_layers):
            tight.attend(layer, torch.randn(4, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))
        tight.end_chunk(torch.randn(1, 50), torch.tensor([3]))
    assert tight.memory().device_peak_bytes <= 0.45 * CFG.full_kv_bytes(n)


def test_factor_store_is_exact_at_full_rank_and_never_larger_than_raw() -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([4, 10, 32, 17])
    x = torch.zeros(4, 2, 32, 16)
    for s, n in enumerate(lengths.tolist()):
        x[s, :, :n] = torch.randn(2, n, 2) @ torch.randn(2, 2, 16)  # rank 2
    x[1, :, :10] = torch.randn(2, 10, 16)  # full rank: stored raw
    store = FactorStore(2, 16, torch.float32)
    ranks = store.add(x, lengths, energy=0.9999, max_rank=32)
    assert ranks.tolist() == [2, 10, 2, 2] and store.raw.view().tolist() == [False, True, False, False]
    heads, spans = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(store.rebuild(heads, spans, lengths, 32), x[spans, heads], atol=1e-5, rtol=1e-4)
    assert store.u.length + store.w.length <= int((lengths * 2 * 16).sum())


def test_row_rank_rule_keeps_a_distinctive_row_the_span_rule_averages_away() -> None:
    torch.manual_seed(0)
    x = torch.zeros(1, 1, 48, 64)
    x[0, 0] = torch.randn(48, 3) @ torch.randn(3, 64) * 10  # 48 tokens of rank 3, large
    x[0, 0, 20] = torch.randn(64)  # one small, unlike row: < 0.1% of the span's energy
    lengths = torch.tensor([48])
    assert float(x[0, 0, 20].square().sum() / x.square().sum()) < 1e-3
    span_rule = FactorStore(1, 64, torch.float32)
    row_rule = FactorStore(1, 64, torch.float32)
    assert span_rule.add(x, lengths, energy=0.999, max_rank=32).tolist() == [3]
    assert row_rule.add(x, lengths, energy=0.999, max_rank=32, rule="row").tolist() == [4]
    one = (torch.tensor([0]), torch.tensor([0]))
    lost = span_rule.rebuild(*one, lengths, 48)[0, 20] - x[0, 0, 20]
    kept = row_rule.rebuild(*one, lengths, 48)[0, 20] - x[0, 0, 20]
    assert float(lost.norm() / x[0, 0, 20].norm()) > 0.5 and float(kept.norm() / x[0, 0, 20].norm()) < 1e-4


def test_exact_rank_rule_stores_spans_raw_and_rebuilds_them_bit_for_bit() -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([5, 32, 17])
    x = torch.zeros(3, 2, 32, 16)
    for s, n in enumerate(lengths.tolist()):
        x[s, :, :n] = torch.randn(2, n, 2) @ torch.randn(2, 2, 16)  # rank 2: the SVD rules would factor it
    store = FactorStore(2, 16, torch.float32)
    assert store.add(x, lengths, energy=0.5, max_rank=1, rule="exact").tolist() == [5, 32, 17]
    assert store.raw.view().all() and store.u.length == 0 and store.w.length == int(lengths.sum()) * 2 * 16
    heads, spans = torch.tensor([1, 0, 1]), torch.tensor([0, 1, 2])
    assert torch.equal(store.rebuild(heads, spans, lengths, 32), x[spans, heads])
    factored = FactorStore(2, 16, torch.float32)
    assert factored.add(x, lengths, energy=0.999, max_rank=32).tolist() == [2, 2, 2]  # what exact overrides
    with pytest.raises(ValueError, match="unknown rank rule"):
        store.add(x, lengths, energy=0.5, max_rank=1, rule="rows")
    store.add(x[:1], lengths[:1], energy=0.5, max_rank=1, rule="exact")  # appends after earlier spans
    assert torch.equal(store.rebuild(torch.tensor([1]), torch.tensor([3]), torch.cat([lengths, lengths[:1]]), 32),
                       x[0:1, 1])


def test_segmentation_covers_every_token_once() -> None:
    torch.manual_seed(0)
    s = torch.rand(300) * 3
    s[[10, 12, 50, 51, 90, 150, 155, 240]] = 9.0
    seg = segment(s, 5.0, 4, 32, anchor_quota=2, forced_anchors=4)
    cover = torch.zeros(300, dtype=torch.long)
    for start, length in zip(seg.span_start.tolist(), seg.span_len.tolist()):
        cover[start: start + length] += 1
        assert 4 <= length <= 32
    cover[seg.anchors] += 1
    assert cover[: seg.consumed].eq(1).all() and cover[seg.consumed:].eq(0).all()
    assert set(seg.anchors.tolist()) >= {0, 1, 2, 3} and len(seg.anchors) == 6


def test_running_stats_match_batch_statistics() -> None:
    values = torch.randn(1000, dtype=torch.float64) * 2 + 5
    stats = RunningStats()
    for part in values.split(137):
        stats.update(part)
    assert abs(stats.mean - float(values.mean())) < 1e-9
    assert abs(stats.std - float(values.std(unbiased=False))) < 1e-9


def test_streaming_keeps_sinks_and_window_within_budget() -> None:
    rope = Rope(CFG)
    n = 3000
    stream = create_policy("streaming", CFG, rope, budget=0.25)
    stream.reserve(n)
    run(stream, n, stream.max_chunk_tokens())
    report = stream.memory()
    assert report.device_peak_bytes <= 0.25 * CFG.full_kv_bytes(n)
    kept = stream.pos[stream.pos >= 0]
    assert set(range(4)) <= set(kept.tolist())  # sinks
    window = kept[kept >= 4]
    assert window.max() == n - 1 and len(window) == stream.capacity - 4  # the most recent tokens
    assert torch.equal(torch.sort(window).values, torch.arange(n - len(window), n))


def test_streaming_equals_full_kv_while_everything_fits() -> None:
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    stream = create_policy("streaming", CFG, rope, budget=10 ** 8, dtype="f32")
    stream.reserve(500)
    for a, b in zip(run(full, 500, 100), run(stream, 500, 100)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_bounded_positions_keep_every_distance_inside_the_trained_window() -> None:
    import dataclasses

    short = dataclasses.replace(CFG, context_length=256)
    rope = Rope(short)
    sekv = create_policy("sekv", short, rope, budget=10 ** 8, l_min=4, l_max=16, recent=32, zoom_k=4,
                         positions="bounded")
    assert sekv.max_tokens() is None
    original = create_policy("sekv", short, rope, budget=10 ** 8, positions="original")
    assert original.max_tokens() == 256
    sekv.reserve(1000)
    query_positions = []
    begin = sekv.begin_chunk

    def checked_begin(positions, is_prefill):
        begin(positions, is_prefill)
        query_positions.append(int(positions.max()) - sekv._shift)  # where RoPE puts the newest query

    sekv.begin_chunk = checked_begin
    outs = run(sekv, 1000, 64)
    assert sekv._shift > 0 and all(torch.isfinite(o).all() for o in outs)
    # every query (hence every query-key distance: keys are clamped at >= 0) stays inside the window
    assert max(query_positions) < 256 and sekv.span_len.length > 10


def read_random_chunk(sekv, positions: torch.Tensor, ids: torch.Tensor, gen: torch.Generator) -> None:
    """One prefill chunk of random q/k/v (tokens `ids` at `positions`) through every layer of `sekv`."""
    T, c = len(ids), sekv.config
    sekv.begin_chunk(positions, True)
    for layer in range(c.n_layers):
        sekv.attend(layer, torch.randn(c.n_heads, T, c.head_dim, generator=gen),
                    torch.randn(c.n_kv_heads, T, c.head_dim, generator=gen),
                    torch.randn(c.n_kv_heads, T, c.head_dim, generator=gen))
    sekv.end_chunk(torch.randn(T, c.vocab_size, generator=gen) * 3, ids)


def bounded_sekv_after_a_document(context: int, n_doc: int, **options):
    """SeKV with bounded positions on CFG cut to a trained window of `context`, after reading n_doc tokens."""
    import dataclasses

    config = dataclasses.replace(CFG, context_length=context)
    sekv = create_policy("sekv", config, Rope(config), budget=int(0.45 * config.full_kv_bytes(max(context, 1100))),
                         l_min=4, l_max=16, recent=32, positions="bounded", **options)
    sekv.reserve(max(context, 1100))
    run(sekv, n_doc, 64)
    sekv.finish_prefill()
    return sekv


@pytest.mark.parametrize("pin_place", ["near", "own"])
def test_bounded_pins_sit_in_document_order_just_before_the_recent_rows(pin_place: str) -> None:
    """Past the trained window a question's pins are attended side by side right before the pending rows
    ("near"), or at their own positions, most of them older than the window ("own", the ablation)."""
    sekv = bounded_sekv_after_a_document(256, 1000, pin_place=pin_place)
    short = sekv.config
    gen = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        read_random_chunk(sekv, torch.arange(1000, 1016), torch.randint(0, 50, (16,), generator=gen), gen)
        sekv.finish_prefill()  # the question is read: its pins are chosen
    assert sekv._shift > 0
    checked = 0
    for pins in sekv._pins:
        if pins is None:
            continue
        spans = pins.mask.nonzero().flatten()
        starts, lengths = sekv.span_pos.view()[spans], sekv.span_len.view()[spans]
        own = torch.cat([torch.arange(int(a), int(a + n)) for a, n in zip(starts, lengths)])
        assert pins.pos.numel() == own.numel() and int(own.min()) < sekv._shift  # pins from before the window
        if pin_place == "own":
            assert torch.equal(torch.sort(pins.pos).values, own)
        else:
            start = int(sekv.pend_pos.view()[0])
            assert torch.equal(torch.sort(pins.pos).values, torch.arange(start - own.numel(), start))
            assert int(pins.pos.min()) - sekv._shift >= 0  # inside the window
        checked += 1
    assert checked == short.n_layers


def test_bound_scores_never_fall_below_any_token_of_the_span() -> None:
    from sekv_local.sekv.router import bound_scores, key_bounds

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 5, 8, 16, generator=g)  # [KV, S, l, D]
    valid = torch.arange(8)[None, :] < torch.tensor([8, 3, 5, 1, 8])[:, None]
    q = torch.randn(2, 4, 16, generator=g)  # one query head per KV head
    bound = bound_scores(q, key_bounds(keys, valid))  # [2, 4, 5]
    exact = torch.einsum("htd,hsld->htsl", q, keys).masked_fill(~valid[None, None], float("-inf")).amax(-1)
    assert torch.all(bound >= exact - 1e-5)
    # a one-token span's bound is that token's score exactly
    assert torch.allclose(bound[..., 3], exact[..., 3], atol=1e-5)


def test_shared_span_factors_are_one_store_per_window_and_smaller_when_layers_agree() -> None:
    """sekv+xkv: with both layers' keys and values drawn from one low-rank token basis, a joint SVD per
    span needs one basis where per-layer, per-head factors need one each: fewer host bytes."""
    rope = Rope(CFG)
    basis = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    stores = {}
    for method in ("sekv", "sekv+xkv"):
        policy = create_policy(method, CFG, rope, budget=10 ** 9, zoom_k=4, energy=0.9999, dtype="f32", recent=16,
                               l_min=16, l_max=32, n_sink=0, anchor_fraction=0.0)
        policy.reserve(400)
        gen.manual_seed(6)
        with torch.inference_mode():
            for start in range(0, 400, 100):
                policy.begin_chunk(torch.arange(start, start + 100), True)
                coeff = torch.randn(100, 3, generator=gen)  # shared by the layers: the same token basis
                for layer in range(CFG.n_layers):
                    mix = torch.randn(2, 16, 16, generator=gen)  # each layer and head: its own block
                    kv = torch.einsum("tr,rd,hde->hte", coeff, basis, mix)
                    policy.attend(layer, torch.randn(4, 100, 16, generator=gen), kv, kv.flip(-1))
                policy.end_chunk(torch.randn(100, 50, generator=gen), torch.randint(0, 50, (100,), generator=gen))
        stores[method] = policy
    shared = stores["sekv+xkv"]
    assert shared.layers[0].fac_k is shared.layers[1].fac_k  # one store for the window
    assert shared.host_tensors(1) == []  # counted once, at the window's first layer
    assert shared.span_len.length == stores["sekv"].span_len.length > 5
    assert shared.memory().host_bytes < stores["sekv"].memory().host_bytes


@pytest.mark.parametrize("fill", [False, True])
def test_learned_router_thresholds_leave_slots_empty_unless_filling(fill: bool) -> None:
    """Thresholds no span reaches: the learned router zooms nothing (every slot -1), or with fill=true
    every slot holds a span, the best-ranked ones."""
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router

    router = Router(CFG, SekvConfig())
    with torch.no_grad():
        router.threshold_logit.fill_(1e6)
    router.trained = True
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=10 ** 9, zoom_k=3, dtype="f32", recent=8, l_min=4, l_max=8,
                         n_sink=2, router_module=router, fill=fill)
    assert sekv.router_kind == "projection"
    run(sekv, 200, 50)
    chosen = torch.stack([c for _, c in sekv._zoom_events])  # [events, KV, 3]
    assert chosen.numel() > 0
    if fill:
        assert bool((chosen >= 0).all()) and bool((chosen < sekv.span_len.length).all())
    else:
        assert bool((chosen == -1).all())


@pytest.mark.parametrize("rank_gate", [True, False])
def test_trained_rank_gate_sets_the_span_rank_unless_switched_off(rank_gate: bool) -> None:
    """A trained rank gate at 50% energy keeps fewer singular vectors than the configured 0.999 (less host
    memory); with rank_gate=false the trained router routes but the spans keep the configured energy."""
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router

    def host_bytes(router_module) -> int:
        sekv = create_policy("sekv", CFG, Rope(CFG), budget=10 ** 9, dtype="f32", recent=8, l_min=4, l_max=8,
                             n_sink=2, router_module=router_module, rank_gate=rank_gate)
        run(sekv, 200, 50)
        return sekv.memory().host_bytes

    router = Router(CFG, SekvConfig())
    with torch.no_grad():
        router.rank_energy_logit.fill_(0.0)  # sigmoid(0): keep half the squared singular values
    router.trained = True
    gated, untrained = host_bytes(router), host_bytes(None)
    if rank_gate:
        assert gated < 0.8 * untrained
    else:
        assert gated == untrained


def test_token_surprisal_equals_the_log_softmax_definition() -> None:
    """-log p(x_t | x_<t): row t - 1 of the chunk predicts token t; token 0's comes from the caller (the engine
    holds the previous chunk's last row); computed from each row's log-normaliser without a [T, V]
    log_softmax."""
    from sekv_local.models.transformer import ChunkScores
    from sekv_local.sekv.segmentation import token_surprisal

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=g) * 4  # two chunks of 7 tokens, vocabulary 50
    ids = torch.randint(0, 50, (2, 7), generator=g)
    whole = torch.log_softmax(logits.reshape(14, 50).double(), dim=-1)
    flat = ids.reshape(14)
    expected = torch.cat([torch.zeros(1, dtype=torch.float64), -whole[:-1].gather(1, flat[1:, None])[:, 0]])
    first = token_surprisal(logits[0], ids[0])
    scores = ChunkScores.from_logits(logits[1], ids[1])
    scores.first_nll = float(-whole[6, ids[1, 0]])
    second = token_surprisal(scores, ids[1])
    assert torch.allclose(torch.cat([first, second]).double(), expected, atol=1e-5)
    assert first[0] == 0 and second[0] > 0
    one_row = token_surprisal(logits[1, -1:], ids[1])  # "last" logits: nothing in the chunk is predicted
    assert torch.count_nonzero(one_row) == 0


def test_union_router_takes_half_the_pool_from_each_rule() -> None:
    """router=union: the first half of every zoom choice is the attention rule's top spans, the rest the
    learned router's best among the others (same memory, same queries: the three runs see one stream)."""
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router

    router = Router(CFG, SekvConfig())
    with torch.no_grad():  # a learned ranking unlike the attention rule's
        router.q_proj.normal_(generator=torch.Generator().manual_seed(3))
    router.trained = True
    events = {}
    for kind in ("attention", "projection", "union"):
        sekv = create_policy("sekv", CFG, Rope(CFG), budget=10 ** 9, zoom_k=4, dtype="f32", recent=8, l_min=4,
                             l_max=8, n_sink=2, router_module=router, router=kind)
        run(sekv, 200, 50)
        events[kind] = torch.stack([c for _, c in sekv._zoom_events])  # [events, KV, 4]
    union, attention, learned = events["union"], events["attention"], events["projection"]
    assert torch.equal(union[..., :2], attention[..., :2])
    differs = 0
    rows = zip(*(x.reshape(-1, 4).tolist() for x in (union, attention, learned)))
    for u, a, p in rows:
        # the learned top 4 less the (at most 2) attention picks still holds the learned top 2 of the rest
        assert len(set(u)) == 4 and u[2:] == [s for s in p if s not in u[:2]][:2]
        differs += set(a) != set(u)
    assert differs > 0  # the union is not just the attention rule


@pytest.mark.parametrize("reads", ["pool", "read_budget"])
def test_prefill_reads_caps_a_document_chunks_pool_at_the_read_budget(reads: str) -> None:
    """prefill_reads=read_budget: a chunk of the document routes only the spans a decode step may read."""
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=10 ** 7, l_min=4, l_max=16, recent=16, zoom_k=12,
                         read_budget=3 * CFG.n_layers * CFG.n_kv_heads * 2 * 16 * CFG.head_dim * 2,
                         prefill_reads=reads)
    sekv.reserve(400)
    run(sekv, 300, 100)
    assert sekv.step_slots == 3 and sekv.span_len.length > 12
    with torch.inference_mode():
        sekv.begin_chunk(torch.arange(300, 350), True)
    assert sekv._step_zoom_k == (12 if reads == "pool" else 3)
    with pytest.raises(Exception, match="prefill_reads must be one of"):
        create_policy("sekv", CFG, Rope(CFG), budget=0.3, prefill_reads="some")


@pytest.mark.parametrize("reread", ["far", "off"])
def test_reread_hands_the_question_back_and_reads_it_with_the_pins_in_place(reread: str) -> None:
    """reread=far past the trained window: once the question's pins are chosen, its rows leave the memory
    and its ids go back to the engine; the chunk read again attends as an answer step (the pins stay, it
    is no new question) and leaves the memory as long as before. reread=off keeps the exact pass's rows."""
    sekv = bounded_sekv_after_a_document(256, 1000, reread=reread)
    gen = torch.Generator().manual_seed(9)
    question = torch.randint(0, 50, (16,), generator=gen)
    with torch.inference_mode():
        read_random_chunk(sekv, torch.arange(1000, 1016), question, gen)
        pending = sekv.pend_pos.length
        sekv.finish_prefill()
        assert sekv._shift > 0
        again = sekv.tokens_to_read_again()
        pins = [p for p in sekv._pins if p is not None]
        assert len(pins) == sekv.config.n_layers
        if reread == "off":
            assert again == [] and sekv.n_tokens == 1016 and sekv.pend_pos.length == pending
            return
        assert again == question.tolist()
        assert sekv.n_tokens == 1000 and sekv.pend_pos.length == pending - 16
        assert sekv.tokens_to_read_again() == []  # handed back once
        done = 0
        while done < 16:  # in the pieces the room beside the pins holds, as the engine feeds them
            assert not sekv.is_question_chunk(is_prefill=True)  # what is read again is not a new question
            n = min(sekv.max_chunk_tokens(), 16 - done)
            read_random_chunk(sekv, torch.arange(1000 + done, 1000 + done + n), torch.tensor(again[done: done + n]), gen)
            done += n
    assert sekv.n_tokens == 1016 and sekv.pend_surprisal.length == sekv.pend_pos.length
    after = [p for p in sekv._pins if p is not None]
    assert len(after) == len(pins)  # the pins stay (a fold meanwhile may add the rows it took to them)
    assert all(set(p.pos.tolist()) <= set(q.pos.tolist()) for p, q in zip(pins, after))
    assert torch.equal(sekv.pend_pos.view()[-16:], torch.arange(1000, 1016))
    assert sekv.is_question_chunk(is_prefill=True)  # the next prefill is the next question


def test_reread_leaves_a_document_inside_the_trained_window_alone() -> None:
    sekv = bounded_sekv_after_a_document(CFG.context_length, 600, reread="far")
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        read_random_chunk(sekv, torch.arange(600, 608), torch.randint(0, 50, (8,), generator=gen), gen)
        sekv.finish_prefill()
    assert sekv._shift == 0 and sekv.tokens_to_read_again() == [] and sekv.n_tokens == 608
