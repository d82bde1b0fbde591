"""Tests for sekv_local.eval.report on synthetic record lists (test fixtures, not benchmark results)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sekv_local.eval import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 1 << 20


def rec(**kw) -> dict:
    """One synthetic record with defaults for every field the benchmark writes."""
    base = dict(engine="torch", method="full", budget=None, model="tiny-test", task="niah", length=4096,
                sample=0, seed=0, turn=0, depth=0.5, score=1.0, prediction="x", answers=["x"],
                n_tokens=4000, prefill_s=1.0, prefill_tokens=4000, decode_s=1.0, decode_tokens=10,
                device_bytes=64 * MIB, device_peak_bytes=80 * MIB, host_bytes=0, full_kv_bytes=64 * MIB)
    base.update(kw)
    return base


def synthetic_records() -> list[dict]:
    """Full KV plus a budgeted method at two budgets, two tasks, two lengths, varying depths."""
    out = []
    for length in (4096, 8192):
        full_kv = 64 * MIB * length // 4096
        for i, depth in enumerate((0.0, 0.3, 0.55, 0.8, 1.0)):
            out.append(rec(length=length, depth=depth, sample=i, full_kv_bytes=full_kv, device_bytes=full_kv,
                           device_peak_bytes=full_kv))
            for budget, score in ((0.25, 0.0 if i % 2 else 1.0), (0.5, 1.0)):
                out.append(rec(method="sekv", budget=budget, length=length, depth=depth, sample=i, score=score,
                               full_kv_bytes=full_kv, device_bytes=int(full_kv * budget),
                               device_peak_bytes=int(full_kv * budget * 1.5), host_bytes=full_kv))
        out.append(rec(task="qa", depth=None, length=length, score=0.5, full_kv_bytes=full_kv,
                       device_bytes=full_kv, device_peak_bytes=full_kv))
    return out


# ---------------------------------------------------------------------------- summarize

def test_summarize_groups_and_means():
    records = [
        rec(score=1.0, device_bytes=16 * MIB, device_peak_bytes=32 * MIB, host_bytes=2 * MIB),
        rec(score=0.0, device_bytes=32 * MIB, device_peak_bytes=64 * MIB, host_bytes=4 * MIB),
        rec(score=0.5, length=8192),
    ]
    rows = report.summarize(records)
    assert [(r["length"], r["n"]) for r in rows] == [(4096, 2), (8192, 1)]
    r = rows[0]
    assert r["accuracy"] == pytest.approx(50.0)
    assert r["device_mib"] == pytest.approx(24.0)
    assert r["device_pct"] == pytest.approx(37.5)      # mean(25%, 50%)
    assert r["peak_pct"] == pytest.approx(75.0)        # mean(50%, 100%)
    assert r["host_mib"] == pytest.approx(3.0)
    assert rows[1]["accuracy"] == pytest.approx(50.0)


def test_throughput_is_sum_over_sum_and_skips_zero_time():
    records = [
        rec(prefill_s=2.0, prefill_tokens=1000, decode_s=1.0, decode_tokens=10),
        rec(prefill_s=1.0, prefill_tokens=2000, decode_s=3.0, decode_tokens=50),
        # a later turn reusing the cache: no prefill; its tokens must not count
        rec(turn=1, prefill_s=0.0, prefill_tokens=30, decode_s=0.0, decode_tokens=5),
    ]
    (row,) = report.summarize(records)
    assert row["n"] == 3
    assert row["prefill_tps"] == pytest.approx(3000 / 3.0)
    assert row["decode_tps"] == pytest.approx(60 / 4.0)   # not the mean of rates (32.5 / 2)


def test_throughput_none_when_no_timed_record():
    (row,) = report.summarize([rec(prefill_s=0.0, decode_s=0.0)])
    assert row["prefill_tps"] is None and row["decode_tps"] is None
    assert "| - | - |" in report.markdown_table([row])


def test_summarize_sort_order_is_stable_and_full_first():
    records = [rec(method="sekv", budget=0.5), rec(method="streaming", budget=0.25),
               rec(method="sekv", budget=0.25), rec(method="full"), rec(engine="llama.cpp-stock", method="full")]
    keys = [(r["engine"], r["method"], r["budget"]) for r in report.summarize(records)]
    assert keys == [("llama.cpp-stock", "full", None), ("torch", "full", None), ("torch", "sekv", 0.25),
                    ("torch", "sekv", 0.5), ("torch", "streaming", 0.25)]
    assert report.summarize(list(reversed(records))) == report.summarize(records)


def test_device_pct_skips_missing_full_kv():
    (row,) = report.summarize([rec(full_kv_bytes=0)])
    assert row["device_pct"] is None and row["peak_pct"] is None


# ---------------------------------------------------------------------------- markdown

def _table_lines(md: str, start: int = 0) -> list[str]:
    """The contiguous block of '|' lines starting at the start-th table in md."""
    blocks, cur = [], []
    for line in md.splitlines():
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    return blocks[start]


def test_markdown_table_structure_and_formatting():
    records = synthetic_records()
    rows = report.summarize(records)
    md = report.markdown_table(rows, title="Results")
    assert md.startswith("## Results\n")
    main = _table_lines(md, 0)
    header = [c.strip() for c in main[0].strip("|").split("|")]
    assert header == ["engine", "method", "budget", "task", "length", "n", "accuracy", "device MiB", "device %",
                      "peak %", "host MiB", "prefill tok/s", "decode tok/s"]
    assert set(main[1].replace("|", "").replace("-", "").replace(":", "")) == set()
    assert len(main) == 2 + len(rows) == 2 + 8   # (full, sekv 25%, sekv 50%) x niah x 2 lengths + qa x 2
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in main[2:]]
    assert all(len(c) == len(header) for c in cells)
    assert {c[2] for c in cells} == {"-", "25%", "50%"}
    assert {c[4] for c in cells} == {"4k", "8k"}
    sekv25_4k = next(c for c in cells if c[1] == "sekv" and c[2] == "25%" and c[4] == "4k")
    assert sekv25_4k[5] == "5" and sekv25_4k[6] == "60.0" and sekv25_4k[8] == "25.0" and sekv25_4k[9] == "37.5"

    pivot = _table_lines(md, 1)
    p_header = [c.strip() for c in pivot[0].strip("|").split("|")]
    assert p_header == ["engine", "method", "budget", "niah 4k", "niah 8k", "qa 4k", "qa 8k", "avg"]
    assert len(pivot) == 2 + 3
    full_row = [c.strip() for c in pivot[2].strip("|").split("|")]
    assert full_row == ["torch", "full", "-", "100.0", "100.0", "50.0", "50.0", "75.0"]
    sekv25 = [c.strip() for c in pivot[3].strip("|").split("|")]
    assert sekv25[:3] == ["torch", "sekv", "25%"] and sekv25[5:7] == ["-", "-"] and sekv25[-1] == "60.0"


def test_markdown_model_column_only_with_several_models():
    one = report.markdown_table(report.summarize([rec()]))
    assert not _table_lines(one)[0].startswith("| model")
    two = report.markdown_table(report.summarize([rec(), rec(model="other-model")]))
    assert _table_lines(two)[0].startswith("| model |")
    assert len(_table_lines(two, 0)) == 4 and len(_table_lines(two, 1)) == 4


def test_format_helpers():
    assert report.fmt_budget(None) == "-"
    assert report.fmt_budget(0.25) == "25%"
    assert report.fmt_budget(0.125) == "12.5%"
    assert report.fmt_budget(0.07) == "7%"
    assert report.fmt_length(4096) == "4k"
    assert report.fmt_length(131072) == "128k"
    assert report.fmt_length(3000) == "3000"


# ---------------------------------------------------------------------------- depth binning

def test_depth_bins():
    assert [report.depth_bin(d) for d in (0.0, 0.19, 0.2, 0.5, 0.79, 0.8, 0.99, 1.0)] == [0, 0, 1, 2, 3, 4, 4, 4]
    assert report.depth_bin_labels() == ["0-20%", "20-40%", "40-60%", "60-80%", "80-100%"]


def test_depth_grid_means_and_empty_cells():
    records = [rec(depth=0.05, score=1.0), rec(depth=0.1, score=0.0), rec(depth=1.0, score=1.0),
               rec(depth=0.5, score=0.0, length=8192), rec(depth=None, score=0.0, task="qa")]
    lengths, grid = report.depth_grid(records)
    assert lengths == [4096, 8192]
    assert grid.shape == (5, 2)
    assert grid[0, 0] == pytest.approx(50.0)
    assert grid[4, 0] == pytest.approx(100.0)
    assert grid[2, 1] == pytest.approx(0.0)
    assert np.isnan(grid[1, 0]) and np.isnan(grid[0, 1])
    assert int(np.isfinite(grid).sum()) == 3


# ---------------------------------------------------------------------------- plots and report folder

def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert 5_000 < len(data) < 5_000_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 300 <= width <= 4000 and 200 <= height <= 4000


@pytest.mark.parametrize("plot", [report.plot_accuracy_by_length, report.plot_accuracy_vs_budget,
                                  report.plot_depth_heatmap])
def test_plots_write_png(tmp_path, plot):
    out = plot(synthetic_records(), tmp_path / "sub" / "plot.png", "synthetic")
    assert out == tmp_path / "sub" / "plot.png"
    assert_png(out)


def test_write_report_all_outputs(tmp_path):
    results = {"config": {"command": ["sekv-local", "bench", "--tasks", "niah,qa"]}, "records": synthetic_records()}
    json.loads(json.dumps(results))  # the payload is plain JSON, as results.json is
    paths = report.write_report(results, tmp_path / "rep", title="Synthetic bench")
    assert set(paths) == {"summary", "accuracy_by_length", "accuracy_vs_budget", "depth_heatmap"}
    for name in ("accuracy_by_length", "accuracy_vs_budget", "depth_heatmap"):
        assert paths[name] == tmp_path / "rep" / f"{name}.png"
        assert_png(paths[name])
    md = paths["summary"].read_text()
    assert md.startswith("# Synthetic bench\n")
    assert "sekv-local bench --tasks niah,qa" in md
    assert "### Accuracy by length" in md
    for name in ("accuracy_by_length", "accuracy_vs_budget", "depth_heatmap"):
        assert f"({name}.png)" in md


def test_write_report_skips_budget_and_depth_plots_when_not_applicable(tmp_path):
    records = [rec(task="qa", depth=None, length=n, score=s) for n, s in ((4096, 1.0), (8192, 0.0))]
    paths = report.write_report({"config": {}, "records": records}, tmp_path)
    assert set(paths) == {"summary", "accuracy_by_length"}
    assert not (tmp_path / "accuracy_vs_budget.png").exists()
    assert not (tmp_path / "depth_heatmap.png").exists()
    md = paths["summary"].read_text()
    assert "```" not in md and "accuracy_vs_budget" not in md
    assert_png(paths["accuracy_by_length"])


def test_write_report_budget_plot_for_single_budgeted_method(tmp_path):
    paths = report.write_report({"config": {}, "records": [rec(method="sekv", budget=0.25, depth=None)]}, tmp_path)
    assert "accuracy_vs_budget" in paths


def test_write_report_without_records(tmp_path):
    paths = report.write_report({"config": {"command": "sekv-local bench"}, "records": []}, tmp_path)
    assert set(paths) == {"summary"}
    assert "No records." in paths["summary"].read_text()


def test_write_report_puts_plots_in_plots_dir_and_lists_refused_cells(tmp_path):
    refused = [rec(method="sekv", budget=0.125, length=2048, sample=s, reason="sekv: cannot hold even the minimum")
               for s in range(2)]
    results = {"config": {}, "records": synthetic_records(), "refused": refused}
    paths = report.write_report(results, tmp_path / "rep", title="Synthetic bench", plots_dir=tmp_path / "img" / "x")
    assert paths["depth_heatmap"] == tmp_path / "img" / "x" / "depth_heatmap.png"
    assert_png(paths["depth_heatmap"])
    assert not (tmp_path / "rep" / "depth_heatmap.png").exists()
    md = paths["summary"].read_text()
    assert "(../img/x/depth_heatmap.png)" in md
    refused_rows = [line for line in md.splitlines() if line.startswith("| torch | sekv | 12.5% |")]
    assert len(refused_rows) == 1 and "| 2k | 2 | sekv: cannot hold even the minimum |" in refused_rows[0]


def test_turn_section_only_for_multi_turn_records():
    assert report.turn_section(synthetic_records()) == []
    records = [rec(task="multiturn_niah", sample=s, turn=t, score=float(t != 2 or s == 0))
               for s in range(2) for t in range(3)]
    lines = report.turn_section(records)
    assert lines[0] == "## Accuracy by conversation turn"
    assert "| turn 1 % | turn 2 % | turn 3 % |" in lines[2]
    assert lines[4] == "| torch | full | - | multiturn_niah | 4k | 2 | 100.0 | 100.0 | 50.0 |"


def test_agreement_pairs_the_same_questions_across_engines():
    assert report.agreement_section(synthetic_records()) == []  # one engine: nothing to compare
    records = []
    for s in range(4):  # native answers differently on sample 3 (wrong) and words sample 2 differently
        records.append(rec(method="sekv", budget=0.25, sample=s, seed=10 + s, score=1.0, prediction=f"a{s}"))
        native_text = f"a{s}" if s < 2 else f"b{s}"
        records.append(rec(engine="llama.cpp", method="sekv", budget=0.25, sample=s, seed=10 + s,
                           score=0.0 if s == 3 else 1.0, prediction=native_text))
    records.append(rec(method="sekv", budget=0.25, sample=4, seed=14))  # torch only: not paired
    rows = report.engine_agreement(records)
    assert len(rows) == 1
    row = rows[0]
    assert (row["engine_a"], row["engine_b"], row["n"]) == ("torch", "llama.cpp", 4)  # the order of the run
    assert (row["accuracy_a"], row["accuracy_b"]) == (100.0, 75.0)
    assert (row["identical"], row["same_verdict"]) == (2, 3)
    lines = report.agreement_section(records)
    assert lines[0] == "## Engines on the same questions"
    assert lines[4] == "| sekv | 25% | torch vs llama.cpp | 4 | 100.0 | 75.0 | -25.0 | 2 / 4 | 3 / 4 |"
