"""RoPE layouts and the sampler (pure tensor code, no model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sekv_local.engines.base import Sampler, SamplingConfig
from sekv_local.errors import ModelError, SekvError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope

BASE = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=100, context_length=512, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_scale=1.0,
                   rope_interleaved=True)


def reference_rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Textbook RoPE on adjacent pairs with complex numbers."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None].double() * freqs[None])
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).reshape(x.shape).float()


def test_interleaved_matches_complex_reference() -> None:
    x, pos = torch.randn(3, 7, 16), torch.arange(100, 107)
    torch.testing.assert_close(Rope(BASE).apply(x, pos), reference_rope(x, pos, 10000.0), atol=1e-5, rtol=1e-5)


def test_neox_is_interleaved_under_the_gguf_permutation() -> None:
    x, pos = torch.randn(2, 5, 16), torch.arange(5)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # interleaved -> halves
    neox = Rope(dataclasses.replace(BASE, rope_interleaved=False))
    torch.testing.assert_close(neox.apply(x[..., perm], pos), Rope(BASE).apply(x, pos)[..., perm], atol=1e-5, rtol=0)


def test_relative_positions_only_and_partial_rotation() -> None:
    rope = Rope(BASE)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    s1 = (rope.apply(q, torch.tensor([10])) * rope.apply(k, torch.tensor([3]))).sum()
    s2 = (rope.apply(q, torch.tensor([1010])) * rope.apply(k, torch.tensor([1003]))).sum()
    assert torch.allclose(s1, s2, atol=1e-3)
    partial = Rope(dataclasses.replace(BASE, rope_dim=8))
    x = torch.randn(1, 4, 16)
    out = partial.apply(x, torch.arange(4))
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.allclose(out[..., :8], x[..., :8])


def test_linear_scaling_and_freq_factors() -> None:
    x = torch.randn(1, 3, 16)
    scaled = Rope(dataclasses.replace(BASE, rope_scale=4.0))
    torch.testing.assert_close(scaled.apply(x, torch.tensor([0, 4, 8])), Rope(BASE).apply(x, torch.tensor([0, 1, 2])))
    factors = Rope(dataclasses.replace(BASE, rope_freq_factors=(2.0,) * 8))
    torch.testing.assert_close(factors.apply(x, torch.tensor([0, 2, 4])), Rope(BASE).apply(x, torch.tensor([0, 1, 2])))
    with pytest.raises(ModelError):
        dataclasses.replace(BASE, rope_freq_factors=(1.0,) * 3)


def test_config_validation() -> None:
    with pytest.raises(ModelError, match="unsupported architecture"):
        dataclasses.replace(BASE, architecture="gpt2")
    with pytest.raises(ModelError, match="multiple"):
        dataclasses.replace(BASE, n_kv_heads=3)
    assert BASE.full_kv_bytes(10) == 10 * 2 * 2 * 2 * 16 * 2


def test_sampler_greedy_and_seeded_sampling() -> None:
    logits = np.array([0.0, 3.0, 1.0, 2.9, -5.0], dtype=np.float32)
    assert Sampler(SamplingConfig())(logits) == 1
    draws = [Sampler(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=s))(logits) for s in range(300)]
    again = [Sampler(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=s))(logits) for s in range(300)]
    assert draws == again and {1, 3} <= set(draws)
    top2 = {Sampler(SamplingConfig(temperature=5.0, top_k=2, seed=s))(logits) for s in range(200)}
    assert top2 == {1, 3}
    # softmax = [.024, .479, .065, .433, .000]: p=0.4 keeps only token 1, p=0.5 keeps tokens 1 and 3
    nucleus = {Sampler(SamplingConfig(temperature=1.0, top_k=0, top_p=0.4, seed=s))(logits) for s in range(200)}
    assert nucleus == {1}
    nucleus = {Sampler(SamplingConfig(temperature=1.0, top_k=0, top_p=0.5, seed=s))(logits) for s in range(200)}
    assert nucleus == {1, 3}
    with pytest.raises(SekvError):
        SamplingConfig(top_p=0)
