"""The grouped path of gqa_attention (few query tokens) against SDPA over explicitly repeated K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sekv_local.cache.attention import GROUPED_MAX_QUERIES, gqa_attention


def reference(q, k, v, mask=None, bias=None):
    """Plain softmax attention with every KV head repeated for its query heads (float64)."""
    group = q.shape[0] // k.shape[0]
    kr, vr = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = q.double() @ kr.transpose(1, 2) / q.shape[-1] ** 0.5
    if bias is not None:
        logits = logits + (bias.double().repeat_interleave(group, 0) if bias.shape[0] == k.shape[0] and group > 1
                           else bias.double())
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, -1) @ vr


@pytest.mark.parametrize("n_query", [1, 7, GROUPED_MAX_QUERIES, GROUPED_MAX_QUERIES + 1])
@pytest.mark.parametrize("kind", ["none", "bias_kv", "bias_heads", "bias_shared", "mask_2d", "mask_heads"])
def test_grouped_path_matches_plain_attention(n_query: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(n_query)
    H, KV, S, D = 9, 3, 50, 16
    q = torch.randn(H, n_query, D, generator=gen)
    k = torch.randn(KV, S, D, generator=gen).half()  # stored K/V may be f16; attention runs in q's dtype
    v = torch.randn(KV, S, D, generator=gen).half()
    see = torch.rand(H, n_query, S, generator=gen) > 0.3
    see[..., 0] = True  # every query sees at least one key
    bias_values = torch.randn(H, n_query, S, generator=gen)
    bias_values[..., 1::4] = float("-inf")
    bias_values[..., 0] = 0.0
    kwargs = {"none": {}, "bias_kv": {"bias": bias_values[::3, :1]}, "bias_heads": {"bias": bias_values},
              "bias_shared": {"bias": bias_values[:1]}, "mask_2d": {"mask": see[0]}, "mask_heads": {"mask": see}}[kind]
    out = gqa_attention(q, k, v, **kwargs)
    assert out.shape == (H, n_query, D) and out.dtype == q.dtype
    expect = reference(q, k, v, mask=kwargs.get("mask"), bias=kwargs.get("bias"))
    assert torch.allclose(out.double(), expect, atol=1e-5), (out.double() - expect).abs().max()
