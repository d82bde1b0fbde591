"""Next-token scores of a prefill chunk (SeKV's surprisal, perplexity) without a [T, vocab] logits tensor."""

from __future__ import annotations

import torch

from sekv_local.cache import create_policy
from sekv_local.models import transformer
from sekv_local.models.rope import Rope
from sekv_local.models.transformer import ChunkScores
from sekv_local.sekv.segmentation import token_surprisal


def test_blocked_scores_equal_the_full_logits(model_path, monkeypatch) -> None:
    from sekv_local.engines.torch_engine import load_transformer

    model = load_transformer(str(model_path), "cpu")
    config = model.config
    # blocks of a few rows: several blocks and a short last one
    monkeypatch.setattr(transformer, "SCORE_BLOCK_BYTES", 16 * 4 * config.vocab_size)
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    outs = {}
    for mode in ("all", "scores"):
        cache = create_policy("full", config, Rope(config), dtype="f32")
        cache.begin_chunk(torch.arange(ids.shape[0]), is_prefill=True)
        with torch.inference_mode():
            outs[mode] = model(ids, cache, logits=mode)
    reference = ChunkScores.from_logits(outs["all"], ids)
    scores = outs["scores"]
    assert scores.nll.shape == (69,) and scores.last.shape == (1, config.vocab_size)
    torch.testing.assert_close(scores.nll, reference.nll, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(scores.last.float(), outs["all"][-1:].float(), atol=1e-4, rtol=1e-5)
    # surprisal from either form is the same; the chunk's first token takes what the caller knows of it
    scores.first_nll = 2.5
    a, b = token_surprisal(scores, ids), token_surprisal(outs["all"], ids)
    torch.testing.assert_close(a[1:], b[1:], atol=1e-4, rtol=1e-5)
    assert a[0] == 2.5 and b[0] == 0 and bool((a[1:] > 0).all())
