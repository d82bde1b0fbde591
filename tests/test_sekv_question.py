"""SeKV's question-time selection (select=question): exact question pass, pinned spans, read budget."""

from __future__ import annotations

import math

import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.cache.attention import attention_with_lse, merge_attention
from sekv_local.models.rope import Rope
from sekv_local.sekv.config import SekvConfig
from sekv_local.sekv.question import (block_attention_with_span_lse, pick_spans, question_span_score,
                                     spread_to_neighbours, voted_spans)

from test_sekv import CFG

EXACT = dict(energy=1.0, max_rank=64, dtype="f32", recent=16, l_min=4, l_max=8, anchor_fraction=0.1, n_sink=2)


def feed(policies, n_tokens: int, start: int, chunk: int, prefill: bool, gen: torch.Generator) -> list[torch.Tensor]:
    """The same random pre-RoPE q/k/v stream into every policy; the last layer's output per chunk and policy."""
    outs = []
    with torch.inference_mode():
        for first in range(start, start + n_tokens, chunk):
            T = min(chunk, start + n_tokens - first)
            qkv = [(torch.randn(4, T, 16, generator=gen), torch.randn(2, T, 16, generator=gen),
                    torch.randn(2, T, 16, generator=gen)) for _ in range(CFG.n_layers)]
            logits, ids = torch.randn(T, 50, generator=gen) * 3, torch.randint(0, 50, (T,), generator=gen)
            row = []
            for p in policies:
                p.begin_chunk(torch.arange(first, first + T), prefill)
                for layer, (q, k, v) in enumerate(qkv):
                    out = p.attend(layer, q, k, v)
                p.end_chunk(logits if prefill else logits[-1:], ids)
                row.append(out)
            outs.append(row)
    return outs


def document_then_question(policies, n_doc: int = 600, n_question: int = 20, chunk: int = 100, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    feed(policies, n_doc, 0, chunk, True, gen)
    for p in policies:
        p.finish_prefill()
    question = feed(policies, n_question, n_doc, n_question, True, gen)
    for p in policies:
        p.finish_prefill()
    return gen, question


def test_the_question_pass_attends_exactly_and_pins_that_cover_everything_decode_exactly() -> None:
    """With exact factors, the question's chunk sees every span's rows (full KV's output), and when the budget
    pins every span, decode steps with no routed slot at all are full KV's too: pinned rows stand in for their
    spans and the spans' coarse rows are out of the softmax."""
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    sekv = create_policy("sekv", CFG, rope, budget=10 ** 9, zoom_k=200, read_budget=1, select="question", **EXACT)
    sekv.reserve(700)
    gen, question = document_then_question([full, sekv])
    assert sekv.span_len.length > 50 and sekv.step_slots == 0  # a 1-byte read budget routes nothing
    torch.testing.assert_close(question[0][1], question[0][0], atol=1e-5, rtol=1e-4)
    assert all(p is not None and bool(p.mask.all()) for p in sekv._pins)
    for full_out, sekv_out in feed([full, sekv], 12, 620, 1, False, gen):
        torch.testing.assert_close(sekv_out, full_out, atol=1e-5, rtol=1e-4)
    assert sekv.host_reads.steps == 12 and sekv.host_reads.step_bytes == 0


def test_without_pins_the_same_steps_differ_from_full_kv() -> None:
    """The check above can fail: with select=step and an empty pool the coarse rows answer instead."""
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    sekv = create_policy("sekv", CFG, rope, budget=10 ** 9, zoom_k=0, select="step", **EXACT)
    sekv.reserve(700)
    gen, _ = document_then_question([full, sekv])
    full_out, sekv_out = feed([full, sekv], 1, 620, 1, False, gen)[0]
    assert (sekv_out - full_out).abs().max() > 1e-3


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_pins_and_routed_reads_stay_within_the_device_and_read_budgets(budget: float) -> None:
    rope = Rope(CFG)
    n = 3000
    sekv = create_policy("sekv", CFG, rope, budget=budget, l_min=4, l_max=32, recent=32, read_budget=0.05,
                         select="question")
    sekv.reserve(n)
    sekv.reset_observations()
    gen, _ = document_then_question([sekv], n_doc=n, n_question=24, chunk=sekv.max_chunk_tokens())
    feed([sekv], 16, n + 24, 1, False, gen)
    report = sekv.memory()
    assert report.device_peak_bytes <= budget * CFG.full_kv_bytes(n), (report.device_peak_bytes, budget)
    pinned = [p for p in sekv._pins if p is not None]
    assert pinned and all(p.pos.shape[0] > 0 for p in pinned)  # the room left pins something
    assert report.device_bytes > report.device_bytes - sum(p.k.nbytes + p.v.nbytes for p in pinned) > 0
    reads = report.host_reads
    assert reads.steps == 16 and 0 < reads.per_step <= 0.05 * CFG.full_kv_bytes(n)
    # the question pass read every span once (and the pinned ones again)
    all_bytes = sum(L.fac_k.all_bytes() + L.fac_v.all_bytes() for L in sekv.layers)
    assert reads.question_bytes >= all_bytes
    obs = sekv.observations()
    assert obs["pinned"] > 0 and obs["zoomed"] and obs["host_reads_per_step_bytes"] == round(reads.per_step)


def read_document(seed: int, reserve: int):
    """A SeKV memory (50%, select=question) that has read an 800-token random document; its generator."""
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=0.5, l_min=4, l_max=16, recent=16, select="question")
    sekv.reserve(reserve)
    gen = torch.Generator().manual_seed(seed)
    feed([sekv], 800, 0, sekv.max_chunk_tokens(), True, gen)
    sekv.finish_prefill()
    return sekv, gen


def test_rollback_drops_the_pins_and_the_next_question_pins_again() -> None:
    sekv, gen = read_document(seed=1, reserve=800)
    mark = sekv.mark()
    feed([sekv], 20, 800, 20, True, gen)
    sekv.finish_prefill()
    assert any(p is not None for p in sekv._pins)
    with torch.inference_mode():
        sekv.rollback(mark)
    assert all(p is None for p in sekv._pins)
    feed([sekv], 20, 800, 20, True, gen)
    sekv.finish_prefill()
    assert any(p is not None for p in sekv._pins)


def test_an_answer_fed_back_keeps_its_pins_and_its_device_budget() -> None:
    """The native engine feeds its decoded tokens back as prefill chunks (`replaying`): they are not a new
    question (the pins stay), they route the decode step's few slots, and in pieces of
    `replay_chunk_tokens` the device peak stays where decode steps keep it."""
    sekv, gen = read_document(seed=2, reserve=900)
    feed([sekv], 20, 800, 20, True, gen)
    sekv.finish_prefill()
    pins = [sekv.pins(layer) for layer in range(CFG.n_layers)]
    assert any(p is not None for p in pins)
    assert sekv.replay_chunk_tokens() <= sekv.recent + sekv.l_max < sekv.chunk_tokens
    position = 820
    with sekv.replaying():
        for _ in range(4):
            n = sekv.replay_chunk_tokens()
            feed([sekv], n, position, n, True, gen)
            position += n
            assert sekv._step_zoom_k <= sekv.step_slots
    assert sekv.n_tokens == position and sekv.span_len.length > 0
    # not a question: the same pinned spans (plus, possibly, spans folded from the answer)
    for before, layer in zip(pins, range(CFG.n_layers)):
        after = sekv.pins(layer)
        if before is not None:
            assert after is not None and after.mask[:before.mask.shape[0]].equal(before.mask)
    assert sekv.memory().device_peak_bytes <= sekv.budget_bytes


def test_many_turns_and_a_question_longer_than_a_chunk_stay_within_the_device_budget() -> None:
    """Turns of a chat: each answer folds its rows into spans (the pinned ones stay exact when the buffers'
    growth fits, counted in whole growth steps), and a question three prefill chunks long folds what its
    earlier chunks leave past the recent window, as a prefill would, instead of holding it all exact."""
    sekv, gen = read_document(seed=3, reserve=2400)
    position, pinned_turns = 800, 0
    for turn in range(24):
        n_question = 3 * sekv.max_chunk_tokens() if turn == 20 else 10 + turn % 7
        feed([sekv], n_question, position, sekv.max_chunk_tokens(), True, gen)
        sekv.finish_prefill()
        pinned_turns += any(p is not None for p in sekv._pins)
        position += n_question
        feed([sekv], 12, position, 1, False, gen)
        position += 12
        assert sekv.memory().device_peak_bytes <= sekv.budget_bytes, f"turn {turn}"
    assert pinned_turns == 24


def test_the_native_engine_takes_both_selections() -> None:
    from sekv_local.native.memory_export import supported

    rope = Rope(CFG)
    for select in ("question", "step"):
        assert supported(create_policy("sekv", CFG, rope, budget=0.5, select=select, router="attention")) is None


def test_block_attention_matches_one_softmax_and_gives_each_spans_share() -> None:
    gen = torch.Generator().manual_seed(0)
    H, KV, T, D, S, pad = 4, 2, 3, 8, 5, 6
    q = torch.randn(H, T, D, generator=gen)
    k, v = torch.randn(KV, S * pad, D, generator=gen), torch.randn(KV, S * pad, D, generator=gen)
    bias = torch.zeros(KV, S * pad)
    bias[:, 4::pad] = float("-inf")  # padding rows
    ek, ev = torch.randn(KV, 7, D, generator=gen), torch.randn(KV, 7, D, generator=gen)
    out, lse, per_span = block_attention_with_span_lse(q, k[:, : 3 * pad], v[:, : 3 * pad], bias[:, : 3 * pad], 3)
    out2, lse2, per_span2 = block_attention_with_span_lse(q, k[:, 3 * pad:], v[:, 3 * pad:], bias[:, 3 * pad:], 2)
    exact = attention_with_lse(q, ek, ev)
    merged = merge_attention([exact, (out, lse), (out2, lse2)])
    keys, values = torch.cat([ek, k], 1), torch.cat([ev, v], 1)
    whole, whole_lse = attention_with_lse(q, keys, values, bias=torch.cat([torch.zeros(KV, 7), bias], 1)[:, None])
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    logits = (q @ keys.repeat_interleave(2, 0).transpose(1, 2)) / math.sqrt(D) \
        + torch.cat([torch.zeros(KV, 7), bias], 1).repeat_interleave(2, 0)[:, None]
    probs = torch.softmax(logits, -1)[..., 7:].reshape(H, T, S, pad).sum(-1)
    share = torch.exp(torch.cat([per_span, per_span2], -1) - whole_lse[..., None])
    torch.testing.assert_close(share, probs, atol=1e-5, rtol=1e-5)


def test_span_scores_and_picking() -> None:
    mass = torch.tensor([[[0.1, 0.5, 0.0], [0.2, 0.0, 0.3]]])  # [H=1, T=2, S=3]
    assert question_span_score(mass, "max").tolist() == pytest.approx([0.2, 0.5, 0.3])
    assert question_span_score(mass, "last").tolist() == pytest.approx([0.2, 0.0, 0.3])
    assert question_span_score(mass, "mean").tolist() == pytest.approx([0.15, 0.25, 0.15])
    lengths = torch.tensor([10, 40, 20])
    score = torch.tensor([0.2, 0.5, 0.3])
    assert pick_spans(score, lengths, 60).tolist() == [1, 2]
    assert pick_spans(score, lengths, 59).tolist() == [1]  # the next best would overflow: it ends the pick
    assert pick_spans(score, lengths, 39).tolist() == []
    with pytest.raises(ValueError):
        question_span_score(mass, "median")


def test_a_pinned_spans_neighbours_rank_right_after_it() -> None:
    # a needle cut by a span boundary: its key's span (2) holds the question's mass, its value's (3) little
    score = torch.tensor([0.01, 0.02, 0.6, 0.03, 0.2, 0.05])
    spread = spread_to_neighbours(score, 0.5)
    assert spread.tolist() == pytest.approx([0.01, 0.3, 0.6, 0.3, 0.2, 0.1])
    lengths = torch.full((6,), 10)
    assert pick_spans(spread, lengths, 30).tolist()[0] == 2  # the span itself still ranks first
    assert set(pick_spans(spread, lengths, 30).tolist()) == {1, 2, 3}
    assert pick_spans(score, lengths, 30).tolist() == [2, 4, 5]  # without spreading the value's span is left out
    assert spread_to_neighbours(score, 0.0) is score
    assert spread_to_neighbours(score[:1], 0.5).tolist() == pytest.approx([0.01])
    for bad in (-0.1, 1.5, True):
        with pytest.raises(Exception, match="pin_spread must be a number in"):
            SekvConfig(pin_spread=bad)


def test_lift_discounts_the_mass_every_question_token_gives() -> None:
    """Span 0 draws a third of every token's attention (position), span 2 a tenth from one token (a match): "max"
    ranks span 0 first, "lift" span 2."""
    mass = torch.full((2, 5, 4), 0.05)
    mass[:, :, 0] = 0.33
    mass[1, 3, 2] = 0.10
    assert int(question_span_score(mass, "max").argmax()) == 0
    lift = question_span_score(mass, "lift")
    assert int(lift.argmax()) == 2
    assert lift[0] == pytest.approx(1.0, rel=0.01) and lift[2] == pytest.approx(0.10 / 0.0525, rel=0.01)


def test_the_vote_pins_what_most_layers_rank_high() -> None:
    """Each layer's favourite differs (position), span 3 is in every layer's top two: the vote ranks it first;
    ties between spans with equal votes go to the better summed rank."""
    scores = torch.tensor([[9.0, 1.0, 2.0, 8.0, 0.0],
                           [1.0, 9.0, 2.0, 8.0, 0.0],
                           [1.0, 2.0, 9.0, 8.0, 0.0]])
    lengths = torch.full((5,), 10)
    votes = voted_spans(scores, lengths, 20)
    assert votes.floor().tolist() == [1.0, 1.0, 1.0, 3.0, 0.0]
    assert pick_spans(votes, lengths, 10).tolist() == [3]
    assert votes[2] > votes[1] > votes[0]  # span 2 is second in two layers, span 1 in one
    assert voted_spans(scores, lengths, 5).floor().tolist() == [0.0] * 5  # no span fits: ranks alone order them
    for bad in (-0.5, 2.0, False):
        with pytest.raises(Exception, match="pin_vote must be a number in"):
            SekvConfig(pin_vote=bad)


def test_voted_pins_are_shared_and_the_rest_of_each_layers_room_is_its_own() -> None:
    sekv = create_policy("sekv", CFG, Rope(CFG), budget=0.9, l_min=4, l_max=16, recent=16, select="question",
                         pin_vote=0.5, pin_score="lift")
    sekv.reserve(800)
    gen, _ = document_then_question([sekv], n_doc=800, chunk=sekv.max_chunk_tokens(), seed=3)
    masks = [p.mask for p in sekv._pins]
    shared = torch.stack(masks).all(dim=0)
    assert 0 < int(shared.sum()) < int(masks[0].sum())
    assert any(not torch.equal(m, masks[0]) for m in masks[1:])  # beside the shared spans, each layer's own
    rows = [int(p.pos.shape[0]) for p in sekv._pins]
    shared_rows = int(sekv.span_len.view()[: shared.shape[0]][shared].sum())
    assert all(shared_rows < n for n in rows)


@pytest.mark.parametrize("method,options", [("sentencekv", {"sentence_end_ids": (3, 7)}), ("xkv", {"budget": 0.9})])
def test_every_host_tier_method_counts_what_a_decode_step_reads(method: str, options: dict) -> None:
    """SentenceKV and xKV gather rows from their host tier at each decode step: the same figure as SeKV's."""
    rope = Rope(CFG)
    policy = create_policy(method, CFG, rope, **{"budget": 0.3, **options})
    policy.reserve(6000)
    gen = torch.Generator().manual_seed(0)
    feed([policy], 6000, 0, policy.max_chunk_tokens() or 256, True, gen)
    policy.finish_prefill()
    policy.reset_observations()
    feed([policy], 4, 6000, 1, False, gen)
    reads = policy.memory().host_reads
    assert reads.steps == 4 and 0 < reads.per_step < CFG.full_kv_bytes(6000)
