"""`analyze layers`: the two similarity measures behave as xKV's argument needs, and the command runs
on the real model."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from sekv_local.cli import cli
from sekv_local.eval.layer_similarity import linear_cka, token_cosine


def test_cka_sees_a_shared_subspace_that_token_cosine_misses() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(500, 64, generator=g)
    rotation, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    unrelated = torch.randn(500, 64, generator=g)
    x = torch.stack([base, base @ rotation, unrelated])  # layer 1 = layer 0 in another basis
    cos, cka = token_cosine(x), linear_cka(x)
    assert torch.allclose(torch.diagonal(cka), torch.ones(3, dtype=cka.dtype))
    assert cka[0, 1] > 0.999  # same token subspace: CKA is rotation invariant
    assert abs(cos[0, 1]) < 0.2  # ...while the same token's vectors are not aligned
    assert cka[0, 2] < 0.3  # independent layers share nothing
    assert torch.allclose(cka, cka.T)


def test_analyze_layers_runs_on_the_default_model(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["analyze", "layers", "--tokens", "128", "--threads", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "key cka" in result.output
    data = json.loads((tmp_path / "layer_similarity.json").read_text())
    assert data["tokens"] == 128
    assert len(data["key_cka"]) == 30
    assert (tmp_path / "layer_similarity.png").stat().st_size > 10_000
