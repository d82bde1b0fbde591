"""Trained-router files, GGUF baking and loading: round trips, refusals, and the real model with
stock llama.cpp and the torch engine."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stock_llama import stock_completion
from sekv_local.engines import EngineOptions
from sekv_local.errors import SekvError
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.models.config import ModelConfig
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.sekv.config import SekvConfig
from sekv_local.sekv.factors import FactorStore
from sekv_local.sekv.router import PARAMETER_SHAPES, Router
from sekv_local.sekv.router_file import (RouterFileError, RouterParams, build_router, gguf_entries, load_router,
                                         params_of, read_gguf_router, save_router)

TINY = ModelConfig(architecture="llama", n_layers=2, n_embd=128, n_ff=256, n_heads=2, n_kv_heads=1, head_dim=64,
                   vocab_size=32, context_length=512, rms_eps=1e-5, rope_base=10000.0, rope_dim=64, rope_scale=1.0,
                   rope_interleaved=True, name="tiny")


def perturbed_router(config: ModelConfig, seed: int = 0) -> Router:
    """An untrained router with every parameter moved, so a round trip that loses one shows."""
    router = Router(config, SekvConfig(routing_dim=16))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in PARAMETER_SHAPES:
            p = getattr(router, name)
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return router


def test_router_stays_under_a_tenth_of_a_percent_of_the_default_model(model_path) -> None:
    gguf_file = GGUFModelFile(model_path)
    config = gguf_file.config
    model_params = sum(math.prod(t.dims) for t in gguf_file._tensors.values())
    router_params = sum(p.numel() for p in Router(config, SekvConfig()).parameters())
    assert router_params / model_params < 0.001, (router_params, model_params)


def test_router_file_round_trip(tmp_path: Path) -> None:
    router = perturbed_router(TINY)
    params = params_of(router, TINY, {"routing_dim": 16, "alpha": 1.0}, {"seed": 3})
    path = save_router(tmp_path / "r.safetensors", params)
    back = load_router(path)
    assert back.dims == params.dims and back.hparams == params.hparams and back.info == {"seed": 3}
    rebuilt = build_router(back, TINY)
    assert rebuilt.trained and rebuilt.routing_dim == 16
    for name in PARAMETER_SHAPES:
        assert torch.equal(getattr(rebuilt, name), getattr(router, name).detach())
        assert not getattr(rebuilt, name).requires_grad


def _saved(tmp_path: Path, **changes) -> Path:
    params = params_of(perturbed_router(TINY), TINY)
    for key, value in changes.items():
        if key == "tensors":
            params.tensors.update(value)
        else:
            params.dims.update(value)
    path = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in params.tensors.items()}, str(path),
              metadata={"sekv.format_version": "1", "sekv.dims": __import__("json").dumps(params.dims)})
    return path


@pytest.mark.parametrize("change, message", [
    ({"tensors": {"q_proj": torch.zeros(2, 64, 8)}}, "shape"),
    ({"tensors": {"threshold_logit": torch.full((2, 2), float("nan"))}}, "non-finite"),
    ({"tensors": {"extra": torch.zeros(1)}}, "unknown router parameters"),
    ({"dims": {"n_kv_heads": 0}}, "must be an integer"),
    ({"dims": {"routing_dim": 128}}, "exceeds head_dim"),
])
def test_bad_router_files_are_refused(tmp_path: Path, change, message) -> None:
    with pytest.raises(RouterFileError, match=message):
        load_router(_saved(tmp_path, **change))


def test_not_a_router_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 40)
    with pytest.raises(RouterFileError, match="not a readable router file"):
        load_router(junk)
    with pytest.raises(RouterFileError, match="not found"):
        load_router(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("auto", [None, "projection", "union"])
def test_the_router_file_names_what_router_auto_runs(auto: str | None) -> None:
    """A router file says which routing `router=auto` uses with it (none said: the learned projection);
    a router named explicitly still gets the trained parameters."""
    from sekv_local.cache import create_policy
    from sekv_local.models.rope import Rope

    params = params_of(perturbed_router(TINY), TINY, info={} if auto is None else {"auto_router": auto})
    router = build_router(params, TINY)
    default = create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=router)
    assert default.router_kind == (auto or "projection")
    assert default.router is router
    named = create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=router, router="union")
    assert named.router_kind == "union" and named.router is router


def test_an_unknown_auto_router_is_refused() -> None:
    params = params_of(perturbed_router(TINY), TINY, info={"auto_router": "attention"})
    with pytest.raises(RouterFileError, match="auto_router must be one of"):
        build_router(params, TINY)


@pytest.mark.parametrize("rule", [None, "span", "row", "exact"])
def test_the_router_file_names_what_rank_rule_auto_runs(rule: str | None) -> None:
    """Likewise for the span rank rule; untrained SeKV and an explicit rank_rule ignore the file."""
    from sekv_local.cache import create_policy
    from sekv_local.models.rope import Rope

    params = params_of(perturbed_router(TINY), TINY, info={} if rule is None else {"rank_rule": rule})
    router = build_router(params, TINY)
    make = lambda **kw: create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=router, **kw)  # noqa: E731
    assert make().rank_rule == (rule or "span")
    assert make(trained=False).rank_rule == "span"
    assert make(rank_rule="row").rank_rule == "row" and make(rank_rule="span").rank_rule == "span"


@pytest.mark.parametrize("pool", [None, "fixed", "free"])
def test_the_router_file_names_what_pool_auto_runs(pool: str | None) -> None:
    """Likewise for the zoom pool; untrained SeKV, an explicit pool and an explicit zoom_k ignore the file."""
    from sekv_local.cache import create_policy
    from sekv_local.models.rope import Rope

    params = params_of(perturbed_router(TINY), TINY, info={} if pool is None else {"zoom_pool": pool})
    router = build_router(params, TINY)
    make = lambda **kw: create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=router, **kw)  # noqa: E731
    assert make().free_pool == (pool == "free")
    assert not make(trained=False).free_pool
    assert make(pool="free").free_pool and not make(pool="fixed").free_pool
    assert not make(zoom_k=4).free_pool


def test_convert_choices_sets_the_file_choices_and_keeps_the_parameters(tmp_path: Path) -> None:
    path = save_router(tmp_path / "r.safetensors", params_of(perturbed_router(TINY), TINY, info={"steps": 7}))
    before = load_router(path)
    run = lambda *args: subprocess.run([sys.executable, "-m", "sekv_local", "convert", "choices", str(path), *args],  # noqa: E731
                                       capture_output=True, text=True)
    shown = run()
    assert shown.returncode == 0 and '"zoom_pool": "fixed"' in shown.stdout and '"auto_router": "projection"' in shown.stdout
    changed = run("--pool", "free", "--rank-rule", "exact")
    assert changed.returncode == 0, changed.stderr
    after = load_router(path)
    assert after.info == {"steps": 7, "zoom_pool": "free", "rank_rule": "exact"}
    assert after.dims == before.dims and after.hparams == before.hparams
    assert all(torch.equal(after.tensors[k], before.tensors[k]) for k in before.tensors)
    refused = run("--pool", "huge")
    assert refused.returncode != 0 and "huge" in refused.stderr and load_router(path).info == after.info


def test_a_reopened_memory_keeps_what_its_router_file_named() -> None:
    """A saved memory restores its own router; the "auto" choices its file named come back with it."""
    from sekv_local.cache import create_policy
    from sekv_local.models.rope import Rope

    named = build_router(params_of(perturbed_router(TINY), TINY,
                                   info={"auto_router": "union", "rank_rule": "row", "zoom_pool": "free"}), TINY)
    plain = build_router(params_of(perturbed_router(TINY), TINY), TINY)
    saved = create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=named)
    reopened = create_policy("sekv", TINY, Rope(TINY), budget=10 ** 9, router_module=plain)
    assert (reopened.router_kind, reopened.rank_rule, reopened.free_pool) == ("projection", "span", False)
    reopened.import_state(*saved.export_state())
    assert (reopened.router_kind, reopened.rank_rule, reopened.free_pool) == ("union", "row", True)


def test_an_unknown_rank_rule_is_refused() -> None:
    params = params_of(perturbed_router(TINY), TINY, info={"rank_rule": "token"})
    with pytest.raises(RouterFileError, match="rank_rule must be one of"):
        build_router(params, TINY)
    with pytest.raises(SekvError, match="rank_rule must be one of"):
        SekvConfig(rank_rule="token")


def test_router_for_other_dims_is_refused() -> None:
    params = params_of(perturbed_router(TINY), TINY)
    other = ModelConfig(**{**TINY.__dict__, "n_layers": 3})
    with pytest.raises(RouterFileError, match="n_layers 2 \\(model: 3\\)"):
        build_router(params, other)


def _metadata_of(params: RouterParams) -> dict:
    return {key: value for key, value, _kind in gguf_entries(params)}


def test_gguf_entries_round_trip() -> None:
    params = params_of(perturbed_router(TINY), TINY, {"alpha": 1.0})
    meta = _metadata_of(params)
    back = read_gguf_router(meta.get, list(meta), "t.gguf")
    assert back is not None and back.dims == params.dims
    for name in PARAMETER_SHAPES:
        assert torch.allclose(back.tensors[name], params.tensors[name])
    assert read_gguf_router({"general.name": "x"}.get, ["general.name"], "t.gguf") is None


@pytest.mark.parametrize("key, value, message", [
    ("sekv.format_version", 99, "format version 99"),
    ("sekv.n_layers", 3, "must hold|missing"),
    ("sekv.routing_dim", "16", "must be an integer"),
    ("sekv.hparams", "[1]", "JSON object"),
    ("sekv.info", "{", "not valid JSON"),
    ("sekv.blk.1.q_proj", [0.0] * 5, "must hold 1024 numbers"),
    ("sekv.blk.0.threshold_logit", [float("inf"), 0.0], "non-finite"),
    ("sekv.blk.0.k_proj", None, "must hold"),
])
def test_damaged_gguf_router_metadata_is_refused(key, value, message) -> None:
    meta = _metadata_of(params_of(perturbed_router(TINY), TINY))
    meta[key] = value
    with pytest.raises(RouterFileError, match=message):
        read_gguf_router(meta.get, list(meta), "t.gguf")


def test_rank_gate_sets_ranks_per_kv_head() -> None:
    torch.manual_seed(0)
    # two KV heads of one span: head 0 nearly rank 1, head 1 full rank; the span's rank is the max
    x = torch.randn(1, 2, 16, 8)
    x[:, 0] = torch.randn(16, 1) @ torch.randn(1, 8) + 1e-3 * torch.randn(16, 8)
    lengths = torch.tensor([16])
    loose = FactorStore(2, 8, torch.float32).add(x, lengths, torch.tensor([0.9, 0.5]), 8)
    tight = FactorStore(2, 8, torch.float32).add(x, lengths, torch.tensor([0.9, 0.999]), 8)
    assert int(loose) < int(tight)
    same = FactorStore(2, 8, torch.float32).add(x, lengths, 0.999, 8)
    assert int(same) == int(tight)


# -- the real model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baked(model_path, tmp_path_factory) -> tuple[Path, RouterParams]:
    from sekv_local.converters.bake import bake

    folder = tmp_path_factory.mktemp("bake")
    config = GGUFModelFile(model_path).config
    params = params_of(perturbed_router(config, seed=1), config, {"routing_dim": 16}, {"note": "test router"})
    router = save_router(folder / "router.safetensors", params)
    return bake(model_path, router, folder / "baked.gguf"), params


def test_bake_adds_the_router_and_keeps_the_model(baked, model_path) -> None:
    from sekv_local.converters.bake import inspect

    path, params = baked
    original, copy = GGUFModelFile(model_path), GGUFModelFile(path)
    assert copy.config == original.config
    assert copy.tensor_names() == original.tensor_names()
    for name in ("token_embd.weight", "blk.7.attn_q.weight", "output_norm.weight"):
        assert bytes(copy._tensors[name].data) == bytes(original._tensors[name].data)
    assert all(copy.metadata(k) == original.metadata(k) for k in original.keys() if not k.startswith("GGUF."))
    found = copy.router_params()
    for name in PARAMETER_SHAPES:
        assert torch.equal(found.tensors[name], params.tensors[name])
    lines = inspect(path)
    assert any("routing_dim 16" in line for line in lines) and any("note=test router" in line for line in lines)
    assert any("no SeKV router" in line for line in inspect(model_path))


def test_stock_llama_cpp_loads_the_baked_model(baked, model_path) -> None:
    # stock llama.cpp refuses GGUFs with tensors it does not create; the router travels as metadata
    outputs = [stock_completion(p) for p in (model_path, baked[0])]
    assert all(o.returncode == 0 for o in outputs), [o.stderr[-500:] for o in outputs]
    assert outputs[0].stdout == outputs[1].stdout and outputs[0].stdout.strip() not in ("", "''")


def test_torch_engine_uses_the_baked_router(baked, model_path, tokenizer) -> None:
    path, params = baked
    engine = TorchEngine(path, tokenizer, EngineOptions(method="sekv", budget=0.25))
    router = engine.cache.router
    assert router.trained and engine.cache.router_kind == "projection"
    assert torch.equal(router.threshold_logit, params.tensors["threshold_logit"])
    assert any("baked into baked.gguf" in n for n in engine.notices)
    ablation = TorchEngine(path, tokenizer, EngineOptions(method="sekv", budget=0.25,
                                                          method_options={"trained": False}))
    assert not ablation.cache.router.trained and ablation.cache.router_kind == "attention"
    default = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25))
    assert default.cache.router.trained and default.cache.router_kind == "projection"
    assert any("packaged for this model" in n for n in default.notices)


def test_a_model_without_a_router_runs_the_untrained_defaults_and_says_so(model_path, tokenizer,
                                                                         monkeypatch, tmp_path: Path) -> None:
    import sekv_local.sekv.router_file as router_file

    monkeypatch.setattr(router_file, "packaged_routers_dir", lambda: tmp_path)  # no router packaged anywhere
    plain = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25))
    assert not plain.cache.router.trained and plain.cache.router_kind == "attention"
    assert any("untrained defaults" in n for n in plain.notices)


def test_cli_bake_refuses_a_router_for_other_dims(model_path, tmp_path: Path) -> None:
    router = save_router(tmp_path / "tiny.safetensors", params_of(perturbed_router(TINY), TINY))
    result = subprocess.run([sys.executable, "-m", "sekv_local.cli", "convert", "bake", str(model_path), str(router),
                             "-o", str(tmp_path / "out.gguf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "trained for another model" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.gguf").exists()


def test_a_memory_brings_back_its_own_router(baked, model_path, tokenizer) -> None:
    # a memory built with the untrained router, loaded where the engine has a trained one: the memory's
    # routing keys belong to its own router, and the engine's shared trained router must stay intact
    path, params = baked
    plain = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25,
                                                           method_options={"trained": False}))
    from sekv_local.eval.tasks import natural_text

    ids = tokenizer.encode(natural_text(9000))
    plain.reserve(len(ids))
    plain.feed(ids)
    plain.finish_prefill()
    tensors, meta = plain.export_state()
    trained = TorchEngine(path, tokenizer, EngineOptions(method="sekv", budget=0.25))
    shared = trained._trained_router()
    trained.import_state(tensors, meta)
    assert trained.cache.router is not shared and not trained.cache.router.trained
    assert trained.cache.router_kind == "attention"
    assert torch.equal(shared.threshold_logit, params.tensors["threshold_logit"]) and shared.trained
