"""SeKV's surprisal over a vocabulary shortlist (`surprisal_vocab`): what it normalises over, and that rollback and
saved memories keep the shortlist the spans were cut with."""

from __future__ import annotations

import pydoc_data.topics
import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.engines import EngineOptions
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.models.rope import Rope

TEXT = pydoc_data.topics.topics["assert"] + pydoc_data.topics.topics["for"]


def sekv_engine(model_path, tokenizer, vocab) -> TorchEngine:
    return TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.5, threads=2,
                                                           method_options={"surprisal_vocab": vocab}))


def chunk_scores(engine: TorchEngine, ids: list[int]):
    """The ChunkScores SeKV's end_chunk receives for `ids` read as one chunk."""
    seen = {}
    end_chunk = engine.cache.end_chunk

    def capture(scores, token_ids):
        seen["scores"] = scores
        end_chunk(scores, token_ids)

    engine.cache.end_chunk = capture
    engine._forward(ids, prefill=True)
    return seen["scores"]


def test_surprisal_normalises_over_the_first_rows_and_the_texts_tokens(model_path, tokenizer) -> None:
    ids = tokenizer.encode(TEXT)[:200]
    engine = sekv_engine(model_path, tokenizer, 500)
    got = chunk_scores(engine, ids)
    full_cache = create_policy("full", engine.config, Rope(engine.config))
    full_cache.begin_chunk(torch.arange(len(ids)), is_prefill=True)
    with torch.inference_mode():
        logits = engine.model(torch.tensor(ids), full_cache, logits="all").float()  # [T, vocab]
    rows = torch.unique(torch.cat([torch.arange(500), torch.tensor(ids)]))
    assert torch.equal(got.rows, rows)
    target = logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    expected = torch.logsumexp(logits[:-1, rows], -1) - target
    exact = torch.logsumexp(logits[:-1], -1) - target
    torch.testing.assert_close(got.nll, expected, atol=2e-3, rtol=1e-4)
    left_out = exact - got.nll  # the mass the shortlist leaves out: never negative, and not nothing
    assert float(left_out.min()) > -2e-3 and float(left_out.mean()) > 0.05
    whole = chunk_scores(sekv_engine(model_path, tokenizer, "all"), ids)
    assert whole.rows is None
    torch.testing.assert_close(whole.nll, exact, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("vocab, rows", [("auto", None), (0, "text")])
def test_auto_keeps_the_whole_vocabulary_of_a_small_one(vocab, rows, model_path, tokenizer) -> None:
    """SmolLM2's 49K rows are below the shortlist's threshold; 0 rows: the text's own tokens only."""
    ids = tokenizer.encode(TEXT)[:64]
    got = chunk_scores(sekv_engine(model_path, tokenizer, vocab), ids)
    assert (got.rows is None) if rows is None else torch.equal(got.rows, torch.unique(torch.tensor(ids)))


def test_rollback_and_a_saved_memory_keep_the_shortlist(model_path, tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    engine = sekv_engine(model_path, tokenizer, 100)
    engine.feed(ids[:300])
    mark, before = engine.mark(), engine.cache.score_rows(torch.tensor([], dtype=torch.long)).clone()
    engine.feed(ids[300:600])
    assert len(engine.cache.score_rows(torch.tensor([], dtype=torch.long))) > len(before)
    tensors, meta = engine.export_state()
    engine.rollback(mark)
    assert torch.equal(engine.cache.score_rows(torch.tensor([], dtype=torch.long)), before)
    reopened = sekv_engine(model_path, tokenizer, 100)
    reopened.import_state(tensors, meta)
    assert torch.equal(reopened.cache.score_rows(torch.tensor([], dtype=torch.long)),
                       torch.unique(torch.cat([torch.arange(100), torch.tensor(ids[:600])])))
