"""`sekv-local convert hf` on a small randomly initialized Llama checkpoint made here with
`transformers` (no download): logits of HF, of our torch engine on the GGUF and of stock llama.cpp on
the GGUF agree, and the router baked in on the way is what the torch engine then uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

IDS = [1, 17, 99, 250, 3, 42, 42, 7, 399, 123, 5, 260, 261, 88, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sekv_local.eval.tasks import natural_text

    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    folder.mkdir()
    corpus = folder.parent / "corpus.txt"
    corpus.write_text(natural_text(200_000))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, num_threads=1, minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    config = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return folder


@pytest.fixture(scope="module")
def converted(checkpoint: Path, tmp_path_factory):
    from test_router_file import perturbed_router

    from sekv_local.models.config import ModelConfig
    from sekv_local.sekv.router_file import params_of, save_router

    folder = tmp_path_factory.mktemp("gguf")
    dims = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                       vocab_size=400, context_length=512, rms_eps=1e-5, rope_base=10000.0, rope_dim=16,
                       rope_scale=1.0, rope_interleaved=True, name="tiny")
    params = params_of(perturbed_router(dims), dims, {}, {"note": "tiny"})
    router = save_router(folder / "router.safetensors", params)
    out = folder / "tiny.gguf"
    result = subprocess.run([sys.executable, "-m", "sekv_local.cli", "convert", "hf", str(checkpoint), "--router",
                             str(router), "-o", str(out), "--outtype", "f32"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, params


@pytest.mark.slow
def test_hf_torch_engine_and_llama_cpp_logits_agree(checkpoint: Path, converted) -> None:
    from transformers import LlamaForCausalLM

    from sekv_local.cache import create_policy
    from sekv_local.models.gguf_file import GGUFModelFile
    from sekv_local.models.rope import Rope
    from sekv_local.models.transformer import Transformer

    path, _ = converted
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(checkpoint).eval()(torch.tensor([IDS])).logits[0].numpy()
    model = Transformer.from_gguf(GGUFModelFile(path)).eval()
    cache = create_policy("full", model.config, Rope(model.config))
    cache.begin_chunk(torch.arange(len(IDS)), is_prefill=True)
    with torch.no_grad():
        ours = model(torch.tensor(IDS), cache, logits="all").numpy()
    script = ("import sys, json, numpy as np; from llama_cpp import Llama\n"
              "m = Llama(sys.argv[1], n_ctx=64, logits_all=True, n_threads=1, verbose=False)\n"
              f"m.eval({IDS}); np.save(sys.argv[2], np.array(m.scores[:{len(IDS)}]))")
    saved = path.parent / "llama_cpp_logits.npy"
    run = subprocess.run([sys.executable, "-c", script, str(path), str(saved)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    stock = np.load(saved)
    scale = np.abs(hf).max()
    assert scale > 1.0  # logits large enough for the comparison to mean something
    for name, logits in (("torch engine", ours), ("stock llama.cpp", stock)):
        print(f"{name} vs HF: max |dlogit| {np.abs(logits - hf).max():.2e} (max |logit| {scale:.2f}), "
              f"argmax agreement {(logits.argmax(-1) == hf.argmax(-1)).mean():.0%}")
        assert np.abs(logits - hf).max() / scale < 1e-3, name
        assert (logits.argmax(-1) == hf.argmax(-1)).all(), name


@pytest.mark.slow
def test_the_converted_gguf_carries_the_router(converted) -> None:
    from sekv_local.converters.bake import inspect
    from sekv_local.models.gguf_file import GGUFModelFile

    path, params = converted
    found = GGUFModelFile(path).router_params()
    for name, value in params.tensors.items():
        assert torch.equal(found.tensors[name], value)
    assert any("note=tiny" in line for line in inspect(path))


def test_not_a_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    from sekv_local.converters.hf import check_checkpoint
    from sekv_local.errors import ModelError

    with pytest.raises(ModelError, match="no config.json"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ModelError, match="not supported"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="no .safetensors"):
        check_checkpoint(tmp_path)
