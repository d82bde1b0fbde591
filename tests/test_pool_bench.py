"""Tests for scripts/pool_bench.py on synthetic bench folders (test fixtures, not benchmark results)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pool_bench.py"
spec = importlib.util.spec_from_file_location("pool_bench", SCRIPT)
pool_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pool_bench)


def rec(method: str, seed: int, sample: int, score: float, length: int = 16000, budget: float | None = 0.25,
        task: str = "niah_multikey") -> dict:
    return dict(engine="torch", method=method, budget=None if method == "full" else budget, model="m", task=task,
                length=length, sample=sample, seed=seed, turn=0, depth=0.5, score=score, prediction="x",
                answers=["x"], n_tokens=length, prefill_s=1.0, prefill_tokens=length, decode_s=1.0,
                decode_tokens=4, device_bytes=1, device_peak_bytes=1, host_bytes=0, full_kv_bytes=4)


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"config": {}, "records": records, "refused": []}))
    return folder


OLD, NEW = "sekv@rank_gate=false@energy=1.0@max_rank=64", "sekv@rank_rule=exact"


def test_alias_pools_two_names_and_counts_a_question_once(tmp_path: Path) -> None:
    # seed 1 ran the setting under its old name only; seed 2 under both names (NEW's answer must win)
    a = write_run(tmp_path / "a", [rec("full", 1, 0, 1.0), rec(OLD, 1, 0, 1.0)])
    b = write_run(tmp_path / "b", [rec("full", 2, 0, 1.0, length=16384), rec(OLD, 2, 0, 1.0, length=16384),
                                   rec(NEW, 2, 0, 0.0, length=16384)])
    records = pool_bench.pool_records([a, b], {OLD: NEW})
    assert sorted((r["method"], r["seed"]) for r in records) == [("full", 1), ("full", 2), (NEW, 1), (NEW, 2)]
    rows = pool_bench.compare(records, "full")
    # 16,000 and 16,384 tokens are one "16K" row; NEW: right on seed 1, wrong on seed 2 (its own answer)
    assert rows == [("16K", "niah_multikey", "full", 2, 2, None, None),
                    ("16K", "niah_multikey", f"{NEW} 25.0%", 1, 2, 0, 1)]


def test_budgets_are_separate_rows(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", [rec("full", 1, 0, 0.0), rec("snapkv", 1, 0, 1.0, budget=0.25),
                                     rec("snapkv", 1, 0, 0.0, budget=0.125)])
    rows = pool_bench.compare(pool_bench.pool_records([run], {}), "full")
    assert [r[2:] for r in rows] == [("full", 0, 1, None, None), ("snapkv 12.5%", 0, 1, 0, 0),
                                     ("snapkv 25.0%", 1, 1, 1, 0)]


def test_command_line_prints_the_pooled_table(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", [rec("full", 1, 0, 1.0), rec(OLD, 1, 0, 1.0)])
    out = subprocess.run([sys.executable, str(SCRIPT), str(run), "--alias", OLD, NEW], check=True,
                         capture_output=True, text=True).stdout
    assert f"| 16K | niah_multikey | {NEW} 25.0% | 1/1 | 100.0 [20.7, 100.0] | 0 | 0 |" in out
    assert OLD not in out


def test_alias_in_renames_only_in_its_folder(tmp_path: Path) -> None:
    # "sekv" meant the untrained router in the old folder and means today's default in the new one
    old = write_run(tmp_path / "old", [rec("full", 1, 0, 1.0), rec("sekv", 1, 0, 0.0)])
    new = write_run(tmp_path / "new", [rec("sekv", 1, 0, 1.0)])
    records = pool_bench.pool_records([old, new], {}, {old: {"sekv": "sekv@trained=false"}})
    assert sorted((r["method"], r["score"]) for r in records) == [
        ("full", 1.0), ("sekv", 1.0), ("sekv@trained=false", 0.0)]
    out = subprocess.run([sys.executable, str(SCRIPT), str(old), str(new), "--alias-in", str(old), "sekv",
                          "sekv@trained=false"], check=True, capture_output=True, text=True).stdout
    assert "| 16K | niah_multikey | sekv 25.0% | 1/1 | 100.0 [20.7, 100.0] | 0 | 0 |" in out
    assert "| 16K | niah_multikey | sekv@trained=false 25.0% | 0/1 | 0.0 [0.0, 79.3] | 0 | 1 |" in out
    bad = subprocess.run([sys.executable, str(SCRIPT), str(new), "--alias-in", str(old), "sekv", "x"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "not pooled" in bad.stderr


def test_right_keeps_partial_credit_and_the_table_shows_the_interval(tmp_path: Path) -> None:
    # string_match_all gave half credit on one question: 1.5 right of 2, not a rounded 2 (or 1)
    run = write_run(tmp_path / "a", [rec("full", 1, 0, 1.0), rec("full", 1, 1, 0.5)])
    (row,) = pool_bench.compare(pool_bench.pool_records([run], {}), "full")
    assert row == ("16K", "niah_multikey", "full", 1.5, 2, None, None)
    assert pool_bench.fmt_right(1.5) == "1.5" and pool_bench.fmt_right(2.0) == "2"
    assert pool_bench.fmt_right(1 / 3 + 1 / 3 + 1 / 3) == "1"
    out = subprocess.run([sys.executable, str(SCRIPT), str(run)], check=True, capture_output=True, text=True).stdout
    assert "| 16K | niah_multikey | full | 1.5/2 | 75.0 [19.8, 97.3] | - | - |" in out   # Wilson 1.5 / 2
    # the pooled summary table above it carries the interval too, and the pivot its n
    assert "| torch | full | - | niah_multikey | 16000 | 2 | 75.0 | [19.8, 97.3] |" in out
    assert "75.0 [19.8, 97.3] (n=2)" in out
