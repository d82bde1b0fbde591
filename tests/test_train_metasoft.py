"""Meta-Soft training on the real model: stage 1 moves the library and not the selector, stage 2
the reverse, a resumed run equals an uninterrupted one, the CLI writes a file that sessions use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sekv_local.metasoft.params_file import load_library
from sekv_local.train.metasoft import MetaSoftTrainConfig, train_metasoft
from sekv_local.train.trainer import checkpoint_path

SMALL = dict(context_tokens=320, query_tokens=16, checkpoint_every=1, validation_samples=2)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    library, _ = load_library(path)
    return {k: v.clone() for k, v in library.state_dict().items()}


@pytest.mark.slow
def test_stages_train_their_own_parameters_and_resume_is_exact(tmp_path: Path) -> None:
    lib_only = _tensors(train_metasoft(MetaSoftTrainConfig(steps=2, library_steps=2, **SMALL),
                                       tmp_path / "a.safetensors", threads=1).out)
    both = _tensors(train_metasoft(MetaSoftTrainConfig(steps=4, library_steps=2, **SMALL),
                                   tmp_path / "b.safetensors", threads=1).out)
    assert not torch.equal(lib_only["library"], torch.zeros_like(lib_only["library"]))
    assert torch.equal(lib_only["library"], both["library"])  # stage 2 leaves the library alone
    assert torch.equal(lib_only["selector_out.weight"], torch.zeros_like(lib_only["selector_out.weight"]))
    from safetensors.torch import load_file

    trained = load_file(str(checkpoint_path(tmp_path / "b.safetensors")))["router.selector_out.weight"]
    assert trained.abs().sum() > 0  # ...and stage 2 trains the selector
    _, info = load_library(tmp_path / "b.safetensors")
    kept = info["selector_kept"]  # kept only when it lowers the held-out error; zeroed otherwise
    assert kept == (info["validation_mse"]["selector"] < info["validation_mse"]["static"])
    assert torch.equal(both["selector_out.weight"], trained if kept else torch.zeros_like(trained))
    # resume: 3 steps, then 4 (the checkpoint continues) == 4 straight
    train_metasoft(MetaSoftTrainConfig(steps=3, library_steps=2, **SMALL), tmp_path / "c.safetensors", threads=1)
    resumed = train_metasoft(MetaSoftTrainConfig(steps=4, library_steps=2, **SMALL), tmp_path / "c.safetensors",
                             threads=1)
    assert resumed.steps_done == 4 and resumed.steps_run == 1
    again = _tensors(resumed.out)
    assert all(torch.equal(both[k], again[k]) for k in both)


@pytest.mark.slow
def test_cli_trains_and_a_session_uses_the_file(tmp_path: Path, tokenizer) -> None:
    from sekv_local.documents import Document
    from sekv_local.session import Session, SessionSettings

    out = tmp_path / "ms.safetensors"
    cmd = [sys.executable, "-m", "sekv_local.cli", "train", "--method", "metasoft", "-o", str(out), "--steps", "2",
           "--context-tokens", "320", "--query-tokens", "16", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training soft tokens" in done.stderr and "Traceback" not in done.stderr
    _, info = load_library(out)
    assert info["steps"] == 2 and info["model"] == "smollm2-135m"
    text = "The access code for Dorin is 4417. " * 60
    settings = SessionSettings(method="metasoft", budget=0.5, threads=2, max_new_tokens=8,
                               method_options=(("params", str(out)),))
    session = Session.create(Document.from_text(text), settings, show_progress=False, tokenizer=tokenizer)
    session.ingest()
    assert any(str(out) in note for note in session.engine.notices)
    assert session.engine.observations()["probes"] >= 1
    bad = SessionSettings(method="metasoft", budget=0.5, method_options=(("params", str(tmp_path / "none.safetensors")),))
    with pytest.raises(Exception, match="not found"):
        Session.create(Document.from_text(text), bad, show_progress=False, tokenizer=tokenizer).ingest()
