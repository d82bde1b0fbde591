"""Meta-Soft parameters baked into the real model's GGUF (metasoft.* metadata), next to a SeKV router:
both survive, the engine uses the baked soft tokens, stock llama.cpp still loads the file, bad
metadata is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stock_llama import stock_completion
from sekv_local.engines import EngineOptions
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.metasoft.library import SoftTokenLibrary
from sekv_local.metasoft.params_file import MetaSoftFileError, read_gguf_library, save_library
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.sekv.router_file import params_of, save_router
from sekv_local.sekv.router import Router
from sekv_local.sekv.config import SekvConfig


@pytest.fixture(scope="module")
def baked_twice(model_path, tmp_path_factory) -> tuple[Path, SoftTokenLibrary]:
    from sekv_local.converters.bake import bake

    folder = tmp_path_factory.mktemp("bake_ms")
    config = GGUFModelFile(model_path).config
    library = SoftTokenLibrary(config.n_embd, 2 * config.n_heads * config.head_dim, n_library=12, n_soft=5, hidden=7)
    torch.manual_seed(3)
    for p in library.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ms = save_library(folder / "ms.safetensors", library, {"steps": 11})
    router = save_router(folder / "router.safetensors", params_of(Router(config, SekvConfig()), config))
    with_router = bake(model_path, router, folder / "router.gguf")
    return bake(with_router, ms, folder / "both.gguf"), library


def test_both_kinds_of_parameters_survive_and_inspect_shows_them(baked_twice) -> None:
    from sekv_local.converters.bake import inspect

    path, library = baked_twice
    g = GGUFModelFile(path)
    assert g.router_params() is not None
    found, info = read_gguf_library(g.metadata, g.keys(), path.name, g.config)
    assert info == {"steps": 11}
    assert all(torch.equal(a, b) for a, b in zip(found.state_dict().values(), library.state_dict().values()))
    text = "\n".join(inspect(path))
    assert "sekv dims" in text and "metasoft dims: n_embd 576" in text and "n_soft 5" in text


def test_engine_uses_the_baked_soft_tokens(baked_twice, tokenizer) -> None:
    path, library = baked_twice
    engine = TorchEngine(path, tokenizer, EngineOptions(method="metasoft", budget=0.25))
    assert torch.equal(engine.cache.library.library, library.library)
    assert any("baked into both.gguf" in n for n in engine.notices)
    plain = TorchEngine(path, tokenizer, EngineOptions(method="metasoft", budget=0.25,
                                                       method_options={"trained": False}))
    assert plain.cache.library.n_soft == 16 and any("untrained" in n for n in plain.notices)


def test_stock_llama_cpp_loads_the_doubly_baked_model(baked_twice, model_path) -> None:
    outputs = [stock_completion(p) for p in (model_path, baked_twice[0])]
    assert all(o.returncode == 0 for o in outputs), [o.stderr[-500:] for o in outputs]
    assert outputs[0].stdout == outputs[1].stdout


@pytest.mark.parametrize("key, value, message", [
    ("metasoft.format_version", 9, "version"),
    ("metasoft.n_library", 10**9, "must be an integer"),
    ("metasoft.n_soft", 99, "more soft tokens"),
    ("metasoft.library", [0.0] * 5, "must hold"),
    ("metasoft.static_logits", [float("nan")] * 60, "non-finite"),
])
def test_damaged_metasoft_metadata_is_refused(baked_twice, key, value, message) -> None:
    g = GGUFModelFile(baked_twice[0])
    metadata = lambda k: value if k == key else g.metadata(k)  # noqa: E731
    with pytest.raises(MetaSoftFileError, match=message):
        read_gguf_library(metadata, g.keys(), "x.gguf", g.config)
