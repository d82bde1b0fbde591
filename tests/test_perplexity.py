"""`sekv-local perplexity` on the real model: the continuation's log-probabilities after a full-KV
context equal teacher forcing over the whole window, and the command writes its table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from sekv_local.engines import EngineOptions
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.eval.perplexity import text_windows


def test_continuation_logprobs_match_teacher_forcing(model_path, tokenizer) -> None:
    window = text_windows(tokenizer, 1, 300, seed=5)[0]
    engine = TorchEngine(model_path, tokenizer, EngineOptions(method="full", threads=2, chunk_size=128))
    forced, _ = engine.score(window)  # log p(window[i+1] | window[:i+1])
    engine.reset()
    engine.feed(window[:256])
    got = engine.continuation_logprobs(window[256:])
    np.testing.assert_allclose(got, forced[255:], atol=2e-3)


def test_cli_writes_one_row_per_method_and_budget(tmp_path: Path) -> None:
    out = tmp_path / "ppl"
    cmd = [sys.executable, "-m", "sekv_local.cli", "perplexity", "--method", "full,streaming", "--budgets", "0.5",
           "--context", "256", "--continuation", "16", "--samples", "2", "--threads", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads((out / "results.json").read_text())["records"]
    assert sorted({(r["method"], r["budget"]) for r in records}) == [("full", None), ("streaming", 0.5)]
    assert all(math.isfinite(r["nll"]) and r["nll"] > 0 for r in records)
    assert all(r["device_peak_fraction"] <= 0.5 for r in records if r["method"] == "streaming")
    assert "| streaming | 50.0% | 2 |" in done.stdout
