"""A block-quantized host tier (host_quant): what it stores, what a rebuild reads back, and its bytes."""

from __future__ import annotations

import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.errors import SekvError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope
from sekv_local.quant_blocks import DEQUANTIZE, QUANTIZE, to_ggml_bytes
from sekv_local.sekv.buffers import QuantFlatBuffer
from sekv_local.sekv.factors import FactorStore


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quant_buffer_reads_back_what_ggml_blocks_hold(qtype: str) -> None:
    torch.manual_seed(0)
    buf = QuantFlatBuffer(qtype, align=64)
    a, b = torch.randn(200), torch.randn(128) * 5
    assert buf.append(a) == 0
    assert buf.append(b) == 256  # aligned: 200 values end inside the 4th row of 64
    padded = torch.zeros(256)
    padded[:200] = a
    want_a = DEQUANTIZE[qtype](*QUANTIZE[qtype](padded.view(-1, 32))).reshape(-1)[:200]
    want_b = DEQUANTIZE[qtype](*QUANTIZE[qtype](b.view(-1, 32))).reshape(-1)
    idx = torch.tensor([0, 31, 32, 199, 17])
    assert torch.equal(buf.take(idx), want_a[idx])
    assert torch.equal(buf.take(256 + torch.arange(128)), want_b)
    assert torch.equal(buf.rows(torch.tensor([4, 5]), 64), want_b.view(2, 64))
    # the stored bytes are ggml's blocks (a tensor of that type could read them in place)
    assert torch.equal(buf.blocks[8:12], to_ggml_bytes(*QUANTIZE[qtype](b.view(-1, 32)), qtype))
    # a truncation then an append: the next write starts at a whole block, nothing before it changes
    buf.truncate(200)
    assert buf.append(b[:64]) == 256 and torch.equal(buf.take(torch.arange(200)), want_a)
    # a saved and reloaded buffer reads the same
    again = QuantFlatBuffer(qtype, align=64)
    again.load_state(buf.state())
    assert again.length == buf.length and torch.equal(again.take(torch.arange(320)), buf.take(torch.arange(320)))
    with pytest.raises(ValueError, match="stored as"):
        QuantFlatBuffer("q8_0" if qtype == "q4_0" else "q4_0").load_state(buf.state())


@pytest.mark.parametrize("qtype, bound", [("q8_0", 0.02), ("q4_0", 0.25)])
def test_quantized_factor_store_rebuilds_within_block_error_at_a_fraction_of_the_bytes(qtype: str, bound: float) -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([5, 32, 17, 40])
    x = torch.zeros(4, 2, 40, 64)
    for s, n in enumerate(lengths.tolist()):
        x[s, :, :n] = torch.randn(2, n, 3) @ torch.randn(2, 3, 64)  # rank 3: factored
    x[1, :, :32] = torch.randn(2, 32, 64)  # full rank: raw
    exact, quant = FactorStore(2, 64, torch.float16), FactorStore(2, 64, torch.float16, quant=qtype)
    for store in (exact, quant):
        assert store.add(x, lengths, energy=0.9999, max_rank=32).tolist() == [3, 32, 3, 3]
    heads, spans = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 1, 2, 3, 3])
    want = exact.rebuild(heads, spans, lengths, 40)
    got = quant.rebuild(heads, spans, lengths, 40)
    real = torch.arange(40)[None, :] < lengths[spans][:, None]
    # each row's error against its span's typical row (a row that nearly cancels has no scale of its own)
    typical = (want.square().sum(-1) * real).sum(-1).div(lengths[spans]).sqrt()  # [pairs]
    err = (got - want).norm(dim=-1) / typical[:, None]
    assert float(err[real].max()) < bound and float(got[~real].abs().max()) == 0.0
    ratio = {"q8_0": 34 / 64, "q4_0": 18 / 64}[qtype]
    assert quant.all_bytes() == pytest.approx(exact.all_bytes() * ratio, rel=0.1)
    assert quant.stored_bytes(heads, spans, lengths) == round(exact.stored_bytes(heads, spans, lengths) * ratio)
    # the store's own save / load
    again = FactorStore(2, 64, torch.float16, quant=qtype)
    again.import_state(quant.export_state("s"), "s")
    assert torch.equal(again.rebuild(heads, spans, lengths, 40), got)
    with pytest.raises(ValueError):
        FactorStore(2, 64, torch.float16).import_state(quant.export_state("s"), "s")


def _config(head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2,
                       head_dim=head_dim, vocab_size=50, context_length=4096, rms_eps=1e-5, rope_base=10000.0,
                       rope_dim=head_dim, rope_scale=1.0, rope_interleaved=True)


CFG = _config(32)


def _read_then_step(cache, n: int) -> torch.Tensor:
    """A random document of n tokens, then one decode step; returns layer 1's output [4, 1, 32]."""
    gen = torch.Generator().manual_seed(1)
    chunk = cache.max_chunk_tokens()
    with torch.inference_mode():
        for start in range(0, n + 1, chunk):
            t = 1 if start == n else min(chunk, n - start)
            cache.begin_chunk(torch.arange(start, start + t), start < n)
            for layer in range(CFG.n_layers):
                out = cache.attend(layer, *(torch.randn(h, t, 32, generator=gen) for h in (4, 2, 2)))
            cache.end_chunk(torch.randn(t, 50, generator=gen) * 3, torch.randint(0, 50, (t,), generator=gen))
    return out


def test_sekv_with_a_quantized_host_tier_reports_its_smaller_host_bytes_and_answers() -> None:
    rope = Rope(CFG)
    n = 3000
    options = dict(budget=0.3, l_min=4, l_max=32, recent=32, zoom_k=4, select="step")
    plain = create_policy("sekv", CFG, rope, **options)
    quant = create_policy("sekv", CFG, rope, host_quant="q8_0", **options)
    outs = []
    for cache in (plain, quant):
        cache.reserve(n + 1)
        outs.append(_read_then_step(cache, n))
    assert quant.span_len.length == plain.span_len.length > 100  # same spans: only the host tier's format differs
    host_plain, host_quant = plain.memory().host_bytes, quant.memory().host_bytes
    assert 0 < host_quant < 0.7 * host_plain, (host_plain, host_quant)
    assert plain.memory().device_bytes == quant.memory().device_bytes
    torch.testing.assert_close(outs[1], outs[0], atol=0.05, rtol=0.05)


def test_host_quant_is_refused_where_rows_do_not_split_into_blocks() -> None:
    odd = _config(24)
    with pytest.raises(SekvError, match="blocks of 32"):
        create_policy("sekv", odd, Rope(odd), budget=0.5, host_quant="q8_0")
    with pytest.raises(SekvError, match="host_quant must be one of"):
        create_policy("sekv", CFG, Rope(CFG), budget=0.5, host_quant="q5_0")
