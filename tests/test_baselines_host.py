"""Baselines on the toy model: llama.cpp-exact KV quantization and SentenceKV (host offload)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.cache.quant import DEQUANTIZE, QUANTIZE, to_ggml_bytes
from sekv_local.cache.sentencekv import SentenceKVCache, sentence_end_ids_from_tokenizer, sentence_lengths
from sekv_local.errors import BudgetError, SekvError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope

torch.set_num_threads(1)

CFG = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                  vocab_size=50, context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_scale=1.0,
                  rope_interleaved=True)
END_IDS = (3, 7)  # toy "sentence end" tokens: ~4% of the random ids


def run(policy, n_tokens: int, chunk: int, seed: int = 0, start: int = 0) -> list[torch.Tensor]:
    """Feed random pre-RoPE q/k/v (same stream for any policy) and return the layer-1 outputs."""
    outs = []
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for first in range(start, start + n_tokens, chunk):
            T = min(chunk, start + n_tokens - first)
            policy.begin_chunk(torch.arange(first, first + T), T > 1)
            for layer in range(CFG.n_layers):
                q = torch.randn(4, T, 16, generator=gen)
                k = torch.randn(2, T, 16, generator=gen)
                v = torch.randn(2, T, 16, generator=gen)
                out = policy.attend(layer, q, k, v)
            policy.end_chunk(torch.randn(T, 50, generator=gen), torch.randint(0, 50, (T,), generator=gen))
            outs.append(out)
    return outs


# -- quantization ---------------------------------------------------------------------------------------
def _data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 128, generator=gen) * torch.rand(96, 1, generator=gen) * 4
    x[0, :32] = 0  # zero block: d = 0
    x[1, :32] = torch.arange(32) - 15.5  # halves: roundf rounds away from zero
    x[2, :32] = torch.tensor([127.0, 2.5, -2.5] + [0.5, -1.5] * 14 + [3.5])
    x[3, :32] = torch.tensor([-8.0, 8.0] + [0.5, 7.5, -0.5] * 10)  # q4_0: +8 clamps to 15
    x[4, :32] = torch.tensor([3.0, -3.0] * 16)  # equal magnitudes: the first wins
    x[5] *= 1e-4
    return x


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_encoders_are_byte_exact_with_gguf(qtype: str) -> None:
    from gguf.quants import dequantize, quantize
    from gguf import GGMLQuantizationType

    ggml = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[qtype]
    x = _data()
    scales, q = QUANTIZE[qtype](x)
    ours = to_ggml_bytes(scales, q, qtype).numpy()
    ref = quantize(x.numpy(), ggml)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours, ref), f"{int((ours != ref).sum())} bytes differ"
    assert np.array_equal(DEQUANTIZE[qtype](scales, q).numpy(), dequantize(ref, ggml))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_round_trip_error_within_the_type_bound(qtype: str) -> None:
    x = _data()
    blocks = x.view(-1, 32)
    err = (DEQUANTIZE[qtype](*QUANTIZE[qtype](x)) - x).view(-1, 32).abs()
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # the f16 scale is off by half an f16 step: relative 2^-11, or 2^-25 absolute in the subnormal range
    def f16_error(d: torch.Tensor) -> torch.Tensor:
        return torch.maximum(d * 2.0 ** -11, torch.full_like(d, 2.0 ** -25))

    if qtype == "q8_0":  # |x - q d| <= d/2, plus the scale's error times |q| <= 127
        d = amax / 127
        bound = d / 2 + 127 * f16_error(d)
    else:  # step d = amax/8; the +8 end clamps to 7: error up to one step, plus the scale's error times 8
        d = amax / 8
        bound = d + 8 * f16_error(d)
    assert (err <= bound + 1e-12).all()
    typical = (amax / 127 / 2) if qtype == "q8_0" else (amax / 8 / 2)
    assert err.mean() < typical.mean()  # most values round to the nearer step


@pytest.mark.parametrize("method,per_32", [("quant-q8_0", 34), ("quant-q4_0", 18), ("quant", 34)])
def test_memory_is_the_quantized_storage(method: str, per_32: int) -> None:
    policy = create_policy(method, CFG, Rope(CFG))
    run(policy, 512, 128)  # capacity grows in steps of 256 tokens: exactly 512 rows
    values = CFG.n_layers * 2 * 512 * CFG.n_kv_heads * CFG.head_dim
    report = policy.memory()
    assert report.device_bytes == values * per_32 // 32
    assert report.device_fraction == pytest.approx(per_32 / 64)
    assert report.host_bytes == 0 and report.tokens == 512


@pytest.mark.parametrize("qtype,tol", [("q8_0", 0.02), ("q4_0", 0.2)])
def test_quantized_attention_is_close_to_full_kv(qtype: str, tol: float) -> None:
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    quant = create_policy("quant", CFG, rope, type=qtype)
    expected, got = run(full, 600, 100), run(quant, 600, 100)
    for a, b in zip(expected, got):
        rel = (b - a).norm() / a.norm()
        assert rel < tol, (qtype, float(rel))
        assert not torch.equal(a, b)


def test_quant_rollback_export_and_refusals() -> None:
    rope = Rope(CFG)
    policy = create_policy("quant-q4_0", CFG, rope)
    run(policy, 300, 100)
    mark = policy.mark()
    run(policy, 50, 25, seed=1, start=300)
    policy.rollback(mark)
    assert policy.n_tokens == 300 and policy.keys[0].length == 300
    tensors, meta = policy.export_state()
    other = create_policy("quant-q4_0", CFG, rope)
    other.import_state(tensors, meta)
    a = run(policy, 1, 1, seed=2, start=300)[0]
    b = run(other, 1, 1, seed=2, start=300)[0]
    assert torch.equal(a, b)
    with pytest.raises(SekvError, match="no --budget"):
        create_policy("quant", CFG, rope, budget=0.5)
    with pytest.raises(SekvError, match="type must be one of"):
        create_policy("quant", CFG, rope, type="q5_0")
    with pytest.raises(SekvError, match="fixes type=q8_0"):
        create_policy("quant-q8_0", CFG, rope, type="q4_0")
    with pytest.raises(SekvError, match="unknown option"):
        create_policy("quant", CFG, rope, bits=4)
    odd = ModelConfig(**{**CFG.__dict__, "head_dim": 8, "n_embd": 32, "rope_dim": 8, "n_kv_heads": 1})
    with pytest.raises(SekvError, match="multiple of 32"):
        create_policy("quant", odd, Rope(odd))


# -- SentenceKV -----------------------------------------------------------------------------------------
def test_sentence_cutting_rules() -> None:
    def cut(ends: list[int], n: int, lo: int, hi: int) -> list[int]:
        flags = torch.zeros(n, dtype=torch.bool)
        flags[ends] = True
        return sentence_lengths(flags, lo, hi)

    assert cut([4, 9, 10], 12, 1, 48) == [5, 5, 1]
    assert cut([4, 9, 10], 12, 3, 48) == [5, 5]  # token 10 alone is too short: it joins the next sentence
    assert cut([], 100, 4, 48) == [48, 48]  # fallback: every max_sentence tokens; the open tail stays
    assert cut([60], 70, 4, 48) == [48, 13]  # a long run is cut at max_sentence, the rest ends at '.'
    assert cut([49], 60, 4, 48) == [48]  # the rest (2 tokens) is too short: stays open
    # causal: a prefix of the tokens gives a prefix of the sentences
    flags = torch.rand(500, generator=torch.Generator().manual_seed(0)) < 0.05
    whole = sentence_lengths(flags, 4, 48)
    part = sentence_lengths(flags[:300], 4, 48)
    assert whole[: len(part)] == part and all(4 <= n <= 48 for n in whole)


def test_sentence_end_ids_from_a_tokenizer() -> None:
    class Toy:
        n_vocab = 8
        texts = [b"the", b".", b" end.", b"?!", b"\n\n", b"", b"3.14", b". "]

        def decode_bytes(self, ids: list[int]) -> bytes:
            return self.texts[ids[0]]

    assert sentence_end_ids_from_tokenizer(Toy()) == (1, 2, 3, 4)
    assert SentenceKVCache.sentence_end_ids_from_tokenizer(Toy()) == (1, 2, 3, 4)


def test_sentencekv_equals_full_kv_when_every_sentence_fits() -> None:
    rope = Rope(CFG)
    full = create_policy("full", CFG, rope, dtype="f32")
    skv = create_policy("sentencekv", CFG, rope, budget=2 * 10 ** 6, dtype="f32", sentence_end_ids=END_IDS,
                        n_start=8, n_recent=8)
    skv.reserve(600)
    expected, got = run(full, 600, 50), run(skv, 600, 50)
    assert skv.sent_len.length > 10 and skv.host_tokens > 400 and skv.working >= skv.host_tokens
    for a, b in zip(expected, got):  # loaded sentences come in score order: attention ignores order
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_sentencekv_budget_holds_in_prefill_and_decode_and_host_holds_the_rest() -> None:
    rope = Rope(CFG)
    n = 3000
    skv = create_policy("sentencekv", CFG, rope, budget=0.25, sentence_end_ids=END_IDS)
    skv.reserve(n)
    run(skv, n, skv.max_chunk_tokens())
    run(skv, 20, 1, seed=3, start=n)  # decode steps
    report = skv.memory()
    limit = 0.25 * CFG.full_kv_bytes(n)
    assert report.device_peak_bytes <= limit, (report.device_peak_bytes, limit)
    assert report.device_bytes > 0.8 * limit  # the working set takes what the budget leaves
    lengths = skv.sent_len.view()
    assert skv.sent_len.length > 50 and 4 <= int(lengths.min()) and int(lengths.max()) <= 48
    assert skv.host_tokens == int(lengths.sum()) == n + 20 - skv.n_start_held - skv.pend_len
    assert skv.pend_len <= skv.cfg.n_recent + skv.cfg.max_sentence
    host_kv = CFG.full_kv_bytes(skv.host_tokens)
    assert host_kv <= report.host_bytes <= 1.3 * host_kv  # f16 rows of every offloaded token (+ growth slack)
    assert report.host_bytes >= 0.9 * CFG.full_kv_bytes(n)
    assert 0 < skv.working < skv.host_tokens  # a real selection: not everything fits
    sel = skv.selected[1]
    assert sel is not None and sel.shape == (CFG.n_kv_heads, skv.working)


def _needle_run(skv: SentenceKVCache, n: int, needle: range, u: torch.Tensor, v_needle: torch.Tensor,
                chunk: int) -> None:
    rope = Rope(CFG)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for first in range(0, n, chunk):
            pos = torch.arange(first, first + chunk)
            skv.begin_chunk(pos, True)
            for layer in range(CFG.n_layers):
                k = torch.randn(2, chunk, 16, generator=gen) * 0.3
                v = torch.randn(2, chunk, 16, generator=gen)
                q = torch.randn(4, chunk, 16, generator=gen) * 0.3
                hit = torch.tensor([p in needle for p in pos.tolist()])
                if hit.any():  # needle keys point along u *after* RoPE at their own positions
                    k[:, hit] = rope.apply(u.expand(2, int(hit.sum()), 16), -pos[hit])
                    v[:, hit] = v_needle
                skv.attend(layer, q, k, v)
            skv.end_chunk(None, torch.full((chunk,), 11))


def test_sentencekv_loads_the_sentence_whose_key_matches_the_query() -> None:
    rope = Rope(CFG)
    n, chunk = 480, 24
    skv = create_policy("sentencekv", CFG, rope, budget=0.5, n_start=4, n_recent=8, max_sentence=16)
    skv.reserve(n)
    needle = range(4 + 16 * 11, 4 + 16 * 12)  # sentence 11 (no end ids: cut every 16 tokens after the start)
    u = torch.zeros(16)
    u[5] = 8.0
    v_needle = torch.linspace(-1, 1, 16)
    _needle_run(skv, n, needle, u, v_needle, chunk)
    assert skv.working < skv.host_tokens // 2  # only a few sentences fit the working set
    offsets = skv.sent_off.view()
    assert int(offsets[11]) + 4 == needle.start and int(skv.sent_len.view()[11]) == 16
    with torch.inference_mode():
        skv.begin_chunk(torch.tensor([n]), False)
        for layer in range(CFG.n_layers):
            q = rope.apply(u.expand(4, 1, 16), torch.tensor([-n]))  # the query, post-RoPE, is u
            out = skv.attend(layer, q, torch.zeros(2, 1, 16), torch.zeros(2, 1, 16))
            chosen = skv.selected[layer]
            assert all(11 in row.tolist() for row in chosen), chosen
            torch.testing.assert_close(out[:, 0], v_needle.expand(4, 16), atol=2e-2, rtol=0)
        skv.end_chunk(None, torch.tensor([11]))


def test_sentencekv_rollback_restores_the_document_state() -> None:
    rope = Rope(CFG)
    skv = create_policy("sentencekv", CFG, rope, budget=0.5, sentence_end_ids=END_IDS)
    skv.reserve(800)
    run(skv, 800, skv.max_chunk_tokens())
    mark = skv.mark()
    state = (skv.n_tokens, skv.sent_len.length, skv.host_tokens, skv.pend_len, skv.n_start_held)
    first = run(skv, 1, 1, seed=7, start=800)[0]
    skv.rollback(mark)
    run(skv, 300, 50, seed=1, start=800)  # a "conversation" that moves more sentences to host
    assert skv.sent_len.length > state[1] and skv.host_tokens > state[2]
    skv.rollback(mark)
    assert (skv.n_tokens, skv.sent_len.length, skv.host_tokens, skv.pend_len, skv.n_start_held) == state
    again = run(skv, 1, 1, seed=7, start=800)[0]
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_sentencekv_bad_configs_raise() -> None:
    rope = Rope(CFG)
    for options in ({"max_sentence": 0}, {"min_sentence": 10, "max_sentence": 8}, {"n_recent": 0},
                    {"n_start": -1}, {"chunk_fraction": 1.0}, {"dtype": "int8"}, {"window": 3},
                    {"sentence_end_ids": (3, 99)}, {"sentence_end_ids": "3,x"}, {"max_sentence": 4.5}):
        with pytest.raises(SekvError):
            create_policy("sentencekv", CFG, rope, budget=0.5, **options)
    with pytest.raises(SekvError, match="needs a --budget"):
        create_policy("sentencekv", CFG, rope)
    with pytest.raises(SekvError, match=r"\(0, 1\]"):
        create_policy("sentencekv", CFG, rope, budget=1.5)
    with pytest.raises(BudgetError, match="Use a budget of at least"):
        create_policy("sentencekv", CFG, rope, budget=0.02).reserve(2000)
    skv = create_policy("sentencekv", CFG, rope, budget=0.5, sentence_end_ids="3, 7")
    assert skv.cfg.sentence_end_ids == (3, 7)
    skv.reserve(2000)
    with pytest.raises(SekvError, match="does not fit"):
        skv.begin_chunk(torch.arange(0, skv.capacity + 1), True)
