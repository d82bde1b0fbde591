"""`analyze layers`: the two similarity measures behave as xKV's argument needs, and the command runs
on the real model."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from sekv_local.cli import cli
from sekv_local.eval.layer_similarity import equal_bytes_rank, linear_cka, sharing_error, token_cosine


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


def _layers_from(bases: list[torch.Tensor], features: int, g: torch.Generator) -> torch.Tensor:
    """[L, T, F]: layer l = bases[l] @ its own random block (each basis [T, r])."""
    return torch.stack([b @ torch.randn(b.shape[1], features, generator=g) for b in bases])


def test_equal_bytes_rank_counts_both_factors() -> None:
    # 4 layers, T=100, F=10 -> 4000 values; G=2: 2 windows of A [100, r] + B [r, 20] = r * (200 + 40)
    assert equal_bytes_rank(0.5, 4, 100, 10, 2) == 2000 // 240
    assert equal_bytes_rank(2.0, 1, 100, 10, 1) == 10  # never above the window's own rank (18 fits)
    assert equal_bytes_rank(0.001, 4, 100, 10, 4) == 0


def test_sharing_pays_only_when_layers_share_a_token_subspace() -> None:
    g = torch.Generator().manual_seed(0)
    T, F, r, L = 256, 32, 4, 8
    shared = torch.randn(T, r, generator=g)
    same = _layers_from([shared] * L, F, g)
    apart = _layers_from([torch.randn(T, r, generator=g) for _ in range(L)], F, g)
    fraction = 0.15  # G=1: rank 4 per layer; G=4: rank 12 per window, < the 16 that 4 independent layers need
    err_same = sharing_error(same, groups=(1, 4), fractions=(fraction, 0.05))
    err_apart = sharing_error(apart, groups=(1, 4), fractions=(fraction,))
    assert err_same[1][fraction] < 1e-6 and err_same[4][fraction] < 1e-6  # both ranks cover the true rank 4
    assert err_same[4][0.05] < 1e-6 < err_same[1][0.05]  # 5%: G=1 gets rank 1, G=4 still rank 4
    assert err_apart[1][fraction] < 1e-6 < err_apart[4][fraction]
    assert sharing_error(apart, groups=(3,), fractions=(1.0,))[3][1.0] < 1e-6  # a shorter last window counts too


def test_analyze_layers_prints_the_equal_bytes_errors(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["analyze", "layers", "--tokens", "96", "--threads", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "equal bytes" in result.output
    sharing = json.loads((tmp_path / "layer_similarity.json").read_text())["sharing_error"]
    assert set(sharing) == {"keys", "values"} and set(sharing["keys"]) == {"1", "2", "4"}
    assert all(0 <= e <= 1 for by_g in sharing.values() for by_f in by_g.values() for e in by_f.values())
