"""Router training on the real model: gradients reach every router parameter, the data is disjoint
from the evaluation text, a resumed run equals an uninterrupted one, and a killed or Ctrl-C'd
training run resumes from its checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from interruptible import interruptible_popen

from sekv_local.sekv.router_file import load_router
from sekv_local.train.trainer import TrainConfig, checkpoint_path, train_router

SMALL = dict(context_tokens=320, query_tokens=16, checkpoint_every=1)


def test_training_text_is_disjoint_from_the_evaluation_haystacks() -> None:
    from sekv_local.eval.tasks import natural_text
    from sekv_local.train.data import docstring_paragraphs, shingles

    paragraphs = docstring_paragraphs()
    evaluation = shingles(natural_text(10**8))
    assert sum(map(len, paragraphs)) > 150_000  # enough text to train on
    assert not any(shingles(p) & evaluation for p in paragraphs)


def test_every_router_parameter_gets_a_gradient(model_path, tokenizer) -> None:
    from sekv_local.models.gguf_file import GGUFModelFile
    from sekv_local.models.prompt import PromptBuilder
    from sekv_local.models.rope import Rope
    from sekv_local.models.transformer import Transformer
    from sekv_local.sekv.config import SekvConfig
    from sekv_local.sekv.router import Router
    from sekv_local.train.data import make_sample
    from sekv_local.train.student import LossWeights, student_losses
    from sekv_local.train.teacher import run_teacher

    model = Transformer.from_gguf(GGUFModelFile(model_path)).eval()
    rope, sekv = Rope(model.config), SekvConfig()
    router = Router(model.config, sekv)
    sample = make_sample(1, 400, 24, tokenizer, PromptBuilder(tokenizer))
    assert sample.kind == "retrieval"
    losses = student_losses(model, rope, router, sekv, run_teacher(model, rope, sample.context, sample.query),
                            LossWeights())
    losses.total.backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(b.grad is None for b in model.buffers())  # the backbone stays frozen
    assert 0 < losses.parts["kl"] < 1 and 0 < losses.parts["target_fraction"] < 1


@pytest.mark.slow
def test_resumed_training_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = train_router(TrainConfig(steps=4, **SMALL), tmp_path / "a.safetensors", threads=1)
    assert straight.finished and len(straight.history) == 4
    part = train_router(TrainConfig(steps=2, **SMALL), tmp_path / "b.safetensors", threads=1)
    assert part.finished and part.steps_done == 2
    resumed = train_router(TrainConfig(steps=4, **SMALL), tmp_path / "b.safetensors", threads=1)
    assert resumed.steps_done == 4 and resumed.steps_run == 2 and [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    a, b = load_router(tmp_path / "a.safetensors"), load_router(tmp_path / "b.safetensors")
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    untrained = train_router(TrainConfig(steps=1, **SMALL), tmp_path / "c.safetensors", threads=1)
    assert not torch.equal(load_router(untrained.out).tensors["threshold_logit"], a.tensors["threshold_logit"])
    with pytest.raises(Exception, match="other settings"):
        train_router(TrainConfig(steps=5, lr=0.5, **SMALL), tmp_path / "b.safetensors", threads=1)


def _train_cmd(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "sekv_local.cli", "train", "-o", str(out), "--steps", str(steps),
            "--context-tokens", "320", "--query-tokens", "16", "--checkpoint-every", "1", "--threads", "1"]


def _wait_for_step(ckpt: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ckpt.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


@pytest.mark.slow
def test_killed_training_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "router.safetensors"
    proc = subprocess.Popen(_train_cmd(out, 4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(checkpoint_path(out), proc)
    proc.kill()
    proc.wait()
    assert not out.exists()
    done = subprocess.run(_train_cmd(out, 4), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    params = load_router(out)
    assert params.info["steps"] == 4
    assert "training router" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_ctrl_c_saves_the_checkpoint_and_says_how_to_resume(tmp_path: Path) -> None:
    out = tmp_path / "router.safetensors"
    proc = interruptible_popen(_train_cmd(out, 50), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(checkpoint_path(out), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Run the same command again to resume" in err and "Traceback" not in err
    step = int(re.search(r"stopped at step (\d+)", err).group(1))
    assert step >= 1
    from safetensors import safe_open

    with safe_open(str(checkpoint_path(out)), framework="pt") as fh:
        assert f'"step": {step}' in fh.metadata()["sekv_train"]
    assert os.path.getsize(checkpoint_path(out)) > 0


@pytest.mark.slow
def test_trained_router_survives_baking_bit_for_bit_and_answers_the_same(tmp_path: Path, model_path, tokenizer,
                                                                          monkeypatch) -> None:
    """train briefly -> bake -> load the baked GGUF: the same router tensors bit for bit, and the same greedy
    answer as the model running the separate router file (found as a router packaged for this model)."""
    import sekv_local.sekv.router_file as router_file
    from sekv_local.converters.bake import bake
    from sekv_local.engines import EngineOptions
    from sekv_local.engines.torch_engine import TorchEngine
    from sekv_local.eval.tasks import natural_text
    from sekv_local.models.gguf_file import GGUFModelFile

    routers = tmp_path / "routers"
    result = train_router(TrainConfig(steps=2, **SMALL), routers / "router.safetensors", threads=1)
    checkpoint_path(result.out).unlink()
    baked = bake(model_path, result.out, tmp_path / "baked.gguf")
    separate, inside = load_router(result.out), GGUFModelFile(baked).router_params()
    assert inside is not None and inside.tensors.keys() == separate.tensors.keys()
    for name, values in separate.tensors.items():
        assert values.dtype == inside.tensors[name].dtype and torch.equal(values, inside.tensors[name]), name

    monkeypatch.setattr(router_file, "packaged_routers_dir", lambda: routers)  # only the file just trained
    text = natural_text(9000)
    prompt = tokenizer.encode(text[:6000] + "\nThe access code of the archive is 4821.\n" + text[6000:]
                              + "\nWhat is the access code of the archive?")
    answers, notes = [], []
    for path in (model_path, baked):
        engine = TorchEngine(path, tokenizer, EngineOptions(method="sekv", budget=0.25))
        assert engine.cache.router.trained and engine.cache.router_kind == "projection"
        engine.reserve(len(prompt) + 16)
        engine.feed(prompt)
        engine.finish_prefill()
        answers.append(list(engine.generate(16)))
        notes.append(" ".join(engine.notices))
    assert "packaged for this model (router.safetensors)" in notes[0] and "baked into baked.gguf" in notes[1]
    assert answers[0] == answers[1] and len(answers[0]) > 0
