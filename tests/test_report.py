"""Tests for sekv_local.eval.report on synthetic record lists (test fixtures, not benchmark results)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sekv_local.eval import report
from sekv_local.eval.scoring import wilson_interval

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
    assert header == ["engine", "method", "budget", "task", "length", "n", "accuracy", "95% CI", "device MiB",
                      "device %", "peak %", "host MiB", "reads/step %", "prefill tok/s", "decode tok/s"]
    assert set(main[1].replace("|", "").replace("-", "").replace(":", "")) == set()
    assert len(main) == 2 + len(rows) == 2 + 8   # (full, sekv 25%, sekv 50%) x niah x 2 lengths + qa x 2
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in main[2:]]
    assert all(len(c) == len(header) for c in cells)
    assert {c[2] for c in cells} == {"-", "25%", "50%"}
    assert {c[4] for c in cells} == {"4k", "8k"}
    sekv25_4k = next(c for c in cells if c[1] == "sekv" and c[2] == "25%" and c[4] == "4k")
    assert sekv25_4k[5] == "5" and sekv25_4k[6] == "60.0" and sekv25_4k[9] == "25.0" and sekv25_4k[10] == "37.5"
    assert sekv25_4k[7] == "[23.1, 88.2]"   # Wilson 3/5

    pivot = _table_lines(md, 1)
    p_header = [c.strip() for c in pivot[0].strip("|").split("|")]
    assert p_header == ["engine", "method", "budget", "niah 4k", "niah 8k", "qa 4k", "qa 8k", "avg"]
    assert len(pivot) == 2 + 3
    full_row = [c.strip() for c in pivot[2].strip("|").split("|")]
    # avg pools the row's questions: (5 + 5 + 0.5 + 0.5) / 12, not the mean of the four cells (75.0)
    assert full_row == ["torch", "full", "-", "100.0 [56.6, 100.0] (n=5)", "100.0 [56.6, 100.0] (n=5)",
                        "50.0 [5.5, 94.5] (n=1)", "50.0 [5.5, 94.5] (n=1)", "91.7 [64.6, 98.5] (n=12)"]
    sekv25 = [c.strip() for c in pivot[3].strip("|").split("|")]
    assert sekv25[:3] == ["torch", "sekv", "25%"] and sekv25[5:7] == ["-", "-"]
    assert sekv25[-1] == "60.0 [31.3, 83.2] (n=10)"   # Wilson 6/10


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
    assert "| turn 1 % [95% CI] | turn 2 % [95% CI] | turn 3 % [95% CI] |" in lines[2]
    assert lines[4] == ("| torch | full | - | multiturn_niah | 4k | 2 | 100.0 [34.2, 100.0] | 100.0 [34.2, 100.0] "
                        "| 50.0 [9.5, 90.5] |")
    # a turn asked fewer times than the first says how many in its own cell
    short = report.turn_section(records[:-1])   # sample 1 lost its third turn
    assert short[4].endswith("| 100.0 [20.7, 100.0] (n=1) |")


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
    assert lines[4] == ("| sekv | 25% | torch vs llama.cpp | 4 | 100.0 [51.0, 100.0] | 75.0 [30.1, 95.4] | -25.0 "
                        "| 2 / 4 | 3 / 4 |")


# ---------------------------------------------------------------------------- Wilson score interval

Z95 = 1.959964


def wilson_closed_form(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's bounds written in counts, (k + z^2/2 -+ z sqrt(k (n - k) / n + z^2 / 4)) / (n + z^2): the same
    interval as the library's proportion form, derived independently here to check it."""
    root = z * math.sqrt(k * (n - k) / n + z * z / 4)
    return (k + z * z / 2 - root) / (n + z * z), (k + z * z / 2 + root) / (n + z * z)


@pytest.mark.parametrize("k, n", [(0, 10), (10, 10), (5, 10), (15, 18), (1, 3), (81, 263)])
def test_wilson_matches_the_closed_formula(k, n):
    low, high = wilson_interval(k, n)
    want_low, want_high = wilson_closed_form(k, n)
    assert low == pytest.approx(want_low, abs=1e-12) and high == pytest.approx(want_high, abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_known_values():
    # 81 of 263 at 95%: the worked example in the literature on binomial intervals, [0.2553, 0.3662]
    low, high = wilson_interval(81, 263)
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    # 0 of 10: the bound is exactly 0, the other the textbook 0.2775 ("rule of three" would say 0.3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(0.27753, abs=1e-5)
    assert wilson_interval(10, 10) == (pytest.approx(0.72247, abs=1e-5), 1.0)
    assert wilson_interval(5, 10) == (pytest.approx(0.23659, abs=1e-5), pytest.approx(0.76341, abs=1e-5))
    assert wilson_interval(15, 18) == (pytest.approx(0.60778, abs=1e-5), pytest.approx(0.94163, abs=1e-5))
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_symmetry_width_and_partial_credit():
    # k right of n mirrors n - k right
    for k in range(8):
        low, high = wilson_interval(k, 7)
        mirror_low, mirror_high = wilson_interval(7 - k, 7)
        assert low == pytest.approx(1 - mirror_high) and high == pytest.approx(1 - mirror_low)
    # more questions, narrower interval at the same accuracy
    widths = [high - low for low, high in (wilson_interval(n / 2, n) for n in (4, 16, 64, 256))]
    assert widths == sorted(widths, reverse=True)
    # fractional sums of scores (partial credit) are taken as they are, and z sets the level
    assert wilson_interval(2.5, 4) == pytest.approx(wilson_closed_form(2.5, 4))
    assert wilson_interval(1 / 3 + 1 / 3 + 1 / 3, 1) == (pytest.approx(0.20655, abs=1e-5), 1.0)
    narrow, wide = wilson_interval(5, 10, z=1.0), wilson_interval(5, 10, z=2.576)
    assert wide[0] < wilson_interval(5, 10)[0] < narrow[0]
    for bad in ((-1, 10), (11, 10), (0, -1)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_fmt_accuracy_cells():
    assert report.fmt_accuracy(5, 10) == "50.0 [23.7, 76.3] (n=10)"
    assert report.fmt_accuracy(5, 10, with_n=False) == "50.0 [23.7, 76.3]"
    assert report.fmt_accuracy(0, 0) == "-"
    assert report.accuracy_interval(0, 0) == (None, None)


def test_summary_rows_carry_the_interval_over_summed_scores():
    # string_match_all partial credit: 1 + 0.5 + 0 + 1 = 2.5 right of 4
    (row,) = report.summarize([rec(score=s, sample=i) for i, s in enumerate((1.0, 0.5, 0.0, 1.0))])
    assert (row["n"], row["right"], row["accuracy"]) == (4, 2.5, 62.5)
    low, high = wilson_closed_form(2.5, 4)
    assert row["ci_low"] == pytest.approx(100 * low) and row["ci_high"] == pytest.approx(100 * high)


def test_write_report_summary_shows_interval_and_n(tmp_path):
    records = [rec(sample=i, score=float(i < 15)) for i in range(18)]           # 15 / 18 on niah 4k
    records += [rec(task="qa", depth=None, sample=i, score=float(i < 1)) for i in range(2)]   # 1 / 2 on qa 4k
    md = report.write_report({"config": {}, "records": records}, tmp_path)["summary"].read_text()
    assert "| torch | full | - | niah | 4k | 18 | 83.3 | [60.8, 94.2] |" in md      # Wilson 15/18
    pivot = _table_lines(md, 1)
    assert pivot[0].endswith("| niah 4k | qa 4k | avg |")
    # avg: Wilson over the 20 pooled questions of the row (16 right)
    assert pivot[2] == ("| torch | full | - | 83.3 [60.8, 94.2] (n=18) | 50.0 [9.5, 90.5] (n=2) "
                        "| 80.0 [58.4, 91.9] (n=20) |")
    assert "95% Wilson score interval" in md
