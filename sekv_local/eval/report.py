"""Benchmark reports: aggregate per-question records into tables (markdown) and plots (PNG).

The benchmark stores one record per answered question in ``results.json``
(``{"config": {...}, "records": [...]}``). This module turns those records into

* :func:`summarize` - one row per (model, engine, method, budget, task, length) with accuracy (and
  its 95% Wilson score interval), memory and throughput figures;
* :func:`markdown_table` - the rows as a GitHub markdown table plus an accuracy-by-length pivot;
* three plots (accuracy by length, accuracy vs measured device budget, needle-depth heat map);
* :func:`write_report` - all of the above written into one folder with a ``summary.md``.

Only plain Python and numpy are used for the numbers; matplotlib (Agg canvas, no pyplot and no
global backend switch) is imported lazily by the plotting functions.
"""

from __future__ import annotations

import os
import shlex
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .scoring import wilson_interval

MIB = float(1 << 20)
N_DEPTH_BINS = 5
GROUP_KEYS = ("model", "engine", "method", "budget", "task", "length")
SERIES_KEYS = ("model", "engine", "method", "budget")

Record = dict[str, Any]


# --------------------------------------------------------------------------------------------
# formatting and grouping helpers

def fmt_budget(budget: float | int | None) -> str:
    """``None`` -> ``"-"``; a fraction of full-KV bytes -> percent, e.g. ``0.25`` -> ``"25%"``; an absolute
    budget in bytes -> MiB, e.g. ``"64 MiB"``."""
    if budget is None:
        return "-"
    return f"{budget / 2**20:g} MiB" if isinstance(budget, int) or budget > 1 else f"{budget * 100:g}%"


def fmt_length(length: int) -> str:
    """Token counts that are multiples of 1024 as ``"4k"``; anything else verbatim."""
    length = int(length)
    return f"{length // 1024}k" if length > 0 and length % 1024 == 0 else str(length)


def _fmt_num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or not np.isfinite(value) else f"{value:.{digits}f}"


def _budget_key(budget: float | None) -> tuple[int, float]:
    return (0, 0.0) if budget is None else (1, float(budget))


def _sort_key(key: tuple) -> tuple:
    """Sort key for a tuple laid out like ``GROUP_KEYS`` (or a prefix of it): full KV first per engine."""
    names = GROUP_KEYS[: len(key)]
    out: list[Any] = []
    for name, value in zip(names, key):
        if name == "method":
            out.append((value != "full", str(value)))
        elif name == "budget":
            out.append(_budget_key(value))
        else:
            out.append(value)
    return tuple(out)


def _group(records: Iterable[Record], keys: Sequence[str]) -> dict[tuple, list[Record]]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for rec in records:
        groups[tuple(rec.get(k) for k in keys)].append(rec)
    return dict(groups)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _accuracy(records: Sequence[Record]) -> float | None:
    """Mean score in percent."""
    return _mean([100.0 * float(r["score"]) for r in records])


def _right(records: Sequence[Record]) -> float:
    """Sum of the per-question scores: partial credit counts as its fraction of a right answer."""
    return float(sum(float(r["score"]) for r in records))


def accuracy_interval(right: float, n: int) -> tuple[float, float] | tuple[None, None]:
    """95% Wilson score interval in percent for ``right`` (sum of scores) of ``n`` questions;
    ``(None, None)`` when there are no questions, so tables print ``-`` rather than a vacuous 0-100."""
    if n <= 0:
        return None, None
    low, high = wilson_interval(right, n)
    return 100.0 * low, 100.0 * high


def fmt_interval(low: float | None, high: float | None, digits: int = 1) -> str:
    """``"[66.1, 92.7]"``, or ``"-"`` when the interval is unknown."""
    if low is None or high is None:
        return "-"
    return f"[{_fmt_num(low, digits)}, {_fmt_num(high, digits)}]"


def fmt_accuracy(right: float, n: int, with_n: bool = True, digits: int = 1) -> str:
    """An accuracy cell: ``"83.3 [66.1, 92.7] (n=20)"`` (percent, 95% Wilson interval, questions).

    ``right`` is the sum of per-question scores. ``with_n=False`` drops ``(n=...)`` for tables that
    already have an ``n`` column. No questions -> ``"-"``."""
    if n <= 0:
        return "-"
    cell = f"{_fmt_num(100.0 * right / n, digits)} {fmt_interval(*accuracy_interval(right, n), digits=digits)}"
    return f"{cell} (n={n})" if with_n else cell


def _device_pct(records: Sequence[Record], field: str = "device_bytes") -> float | None:
    """Mean of ``field / full_kv_bytes`` in percent (records without a full-KV size are skipped)."""
    return _mean([100.0 * r[field] / r["full_kv_bytes"] for r in records if r.get("full_kv_bytes")])


def _throughput(records: Sequence[Record], phase: str) -> float | None:
    """Tokens per second over a group: sum of tokens / sum of seconds, skipping records with 0 s
    (e.g. later turns that reuse the cache and did no prefill)."""
    timed = [r for r in records if r.get(f"{phase}_s", 0) > 0]
    seconds = sum(float(r[f"{phase}_s"]) for r in timed)
    return sum(int(r[f"{phase}_tokens"]) for r in timed) / seconds if seconds > 0 else None


def series_label(model: str | None, engine: str, method: str, budget: float | None,
                 with_model: bool = False) -> str:
    """Legend label for one (engine, method, budget) series, e.g. ``"torch / sekv @ 25%"``."""
    label = f"{engine} / {method}" + ("" if budget is None else f" @ {fmt_budget(budget)}")
    return f"{model}: {label}" if with_model else label


def _models(records: Iterable[Record]) -> list[str]:
    return sorted({str(r.get("model")) for r in records})


# --------------------------------------------------------------------------------------------
# tables

def summarize(records: list[Record]) -> list[dict]:
    """One row per (model, engine, method, budget, task, length), sorted (full KV first per engine).

    Row keys: the six group keys plus ``n``, ``accuracy`` (% mean score), ``right`` (sum of the
    scores, fractional with partial credit), ``ci_low`` and ``ci_high`` (95% Wilson score interval of
    the accuracy, in %, see :func:`~sekv_local.eval.scoring.wilson_interval`), ``device_mib``,
    ``device_pct`` and ``peak_pct`` (mean device / peak device bytes as % of full-KV bytes),
    ``host_mib``, ``reads_pct`` (mean host bytes gathered per decode step as % of full-KV bytes; None for
    records written before it was measured), ``prefill_tps`` and ``decode_tps`` (sum tokens / sum seconds, ignoring records
    whose time for that phase is 0). Figures that cannot be computed are ``None``.
    """
    groups = _group(records, GROUP_KEYS)
    rows = []
    for key in sorted(groups, key=_sort_key):
        g = groups[key]
        right = _right(g)
        ci_low, ci_high = accuracy_interval(right, len(g))
        rows.append(dict(
            zip(GROUP_KEYS, key),
            n=len(g),
            accuracy=_accuracy(g),
            right=right,
            ci_low=ci_low,
            ci_high=ci_high,
            device_mib=_mean([r["device_bytes"] / MIB for r in g]),
            device_pct=_device_pct(g, "device_bytes"),
            peak_pct=_device_pct(g, "device_peak_bytes"),
            host_mib=_mean([r["host_bytes"] / MIB for r in g]),
            reads_pct=_device_pct(g, "host_reads_per_step_bytes") if all("host_reads_per_step_bytes" in r for r in g)
            else None,
            prefill_tps=_throughput(g, "prefill"),
            decode_tps=_throughput(g, "decode"),
        ))
    return rows


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]], right_from: int) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return [_md_row(header), "|" + "|".join(align) + "|", *(_md_row(r) for r in body)]


def _pivot(rows: list[dict]) -> tuple[list[tuple], list[tuple], dict[tuple, dict[tuple, dict]]]:
    """Pivot summary rows: (series keys, (task, length) columns, {series: {column: summary row}})."""
    cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for row in rows:
        if row["accuracy"] is not None:
            cells[tuple(row[k] for k in SERIES_KEYS)][(row["task"], row["length"])] = row
    series = sorted(cells, key=_sort_key)
    columns = sorted({c for v in cells.values() for c in v})
    return series, columns, dict(cells)


def accuracy_pivot(rows: list[dict]) -> tuple[list[tuple], list[tuple], dict[tuple, dict[tuple, float]]]:
    """Pivot summary rows: (series keys, (task, length) columns, {series: {column: accuracy}}).

    A series is (model, engine, method, budget)."""
    series, columns, cells = _pivot(rows)
    return series, columns, {s: {c: row["accuracy"] for c, row in by_col.items()} for s, by_col in cells.items()}


INTERVAL_NOTE = ("Accuracy intervals are 95% Wilson score intervals over the questions of a cell; a question "
                 "with partial credit (some of several needles) counts as its fraction of a right answer.")


def markdown_table(rows: list[dict], title: str | None = None) -> str:
    """Summary rows as GitHub markdown: the full table (with a ``95% CI`` column next to the
    accuracy), then a compact "accuracy by length" pivot (one row per engine/method/budget, a column
    per task and length, plus ``avg``), whose cells read ``accuracy [95% CI] (n=questions)``.

    ``avg`` pools every question of the row (sum of scores / questions, Wilson interval over all of
    them), so it weights each cell by its question count; with equal counts per cell it is the plain
    mean of the cells. A ``model`` column appears only when the rows hold more than one model."""
    multi = len({r["model"] for r in rows}) > 1
    lead = ["model"] if multi else []
    header = lead + ["engine", "method", "budget", "task", "length", "n", "accuracy", "95% CI", "device MiB",
                     "device %", "peak %", "host MiB", "reads/step %", "prefill tok/s", "decode tok/s"]
    body = [([r["model"]] if multi else [])
            + [r["engine"], r["method"], fmt_budget(r["budget"]), r["task"], fmt_length(r["length"]),
               str(r["n"]), _fmt_num(r["accuracy"]), fmt_interval(r.get("ci_low"), r.get("ci_high")),
               _fmt_num(r["device_mib"]), _fmt_num(r["device_pct"]),
               _fmt_num(r["peak_pct"]), _fmt_num(r["host_mib"]), _fmt_num(r.get("reads_pct")),
               _fmt_num(r["prefill_tps"]),
               _fmt_num(r["decode_tps"])]
            for r in rows]
    lines = [f"## {title}", ""] if title else []
    lines += _md_table(header, body, right_from=len(lead) + 5)

    series, columns, cells = _pivot(rows)
    if series:
        p_header = lead + ["engine", "method", "budget"] + [f"{t} {fmt_length(n)}" for t, n in columns] + ["avg"]
        p_body = []
        for s in series:
            model, engine, method, budget = s
            present = cells[s]
            # rows built without ``right`` (not by summarize) still carry accuracy and n
            right = {c: r.get("right", r["accuracy"] * r["n"] / 100.0) for c, r in present.items()}
            p_body.append(([model] if multi else []) + [engine, method, fmt_budget(budget)]
                          + [fmt_accuracy(right[c], present[c]["n"]) if c in present else "-" for c in columns]
                          + [fmt_accuracy(sum(right.values()), sum(r["n"] for r in present.values()))])
        lines += ["", "### Accuracy by length (%)", "",
                  "Each cell: accuracy % [95% CI] (n = questions); avg pools all questions of the row.", ""]
        lines += _md_table(p_header, p_body, right_from=len(lead) + 3)
    lines += ["", INTERVAL_NOTE]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# plots

def _figure(n_panels: int, panel_w: float = 5.0, panel_h: float = 3.8, max_cols: int = 3):
    """A constrained-layout Agg figure with ``n_panels`` axes (flattened list, extras removed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(1, min(n_panels, max_cols))
    nrows = max(1, -(-n_panels // ncols))
    # at least 9 in wide: a one-panel figure must still fit its title and a legend of many methods
    fig = Figure(figsize=(max(panel_w * ncols, 9.0), panel_h * nrows + 1.2), layout="constrained", dpi=110)
    FigureCanvasAgg(fig)
    axes = list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel())
    for ax in axes[n_panels:]:
        ax.remove()
    return fig, axes[:n_panels]


def _title(title: str, records: Sequence[Record]) -> str:
    models = [m for m in _models(records) if m not in title]
    return f"{title} - {', '.join(models)}" if models else title


def _style_cycle() -> Callable[[int], dict]:
    colors = [f"C{i}" for i in range(10)]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    styles = ["-", "--", "-.", ":"]
    # methods with identical results draw on top of each other: later series get smaller markers
    # (drawn concentrically on the earlier ones) and other dashes, so every one stays visible
    return lambda i: {"color": colors[i % len(colors)], "marker": markers[i % len(markers)],
                      "linestyle": styles[i % len(styles)], "markersize": max(13 - 0.9 * i, 3.5)}


def _finish(fig, path: Path, title: str, handles: dict) -> Path:
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(len(handles), 3), fontsize="small", frameon=False)
    fig.suptitle(title, wrap=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _pct_axis(ax, axis: str = "y", top: float = 100.0) -> None:
    lim = (-3.0, top + 3.0)
    if axis == "y":
        ax.set_ylim(*lim)
    else:
        ax.set_xlim(*lim)
    ax.grid(True, alpha=0.3)


def plot_accuracy_by_length(records: list[Record], path: Path, title: str) -> Path:
    """One panel per task: accuracy (%) against context length, one line per engine/method/budget."""
    tasks = sorted({r["task"] for r in records})
    multi = len(_models(records)) > 1
    series = sorted(_group(records, SERIES_KEYS), key=_sort_key)
    style = _style_cycle()
    fig, axes = _figure(len(tasks))
    handles: dict[str, Any] = {}
    for ax, task in zip(axes, tasks):
        by_series = _group([r for r in records if r["task"] == task], SERIES_KEYS)
        lengths = sorted({r["length"] for r in records if r["task"] == task})
        for i, s in enumerate(series):
            if s not in by_series:
                continue
            by_len = _group(by_series[s], ["length"])
            xs = sorted(k[0] for k in by_len)
            ys = [_accuracy(by_len[(x,)]) for x in xs]
            label = series_label(*s, with_model=multi)
            (line,) = ax.plot(xs, ys, label=label, linewidth=1.6, **style(i))
            handles.setdefault(label, line)
        if lengths and lengths[0] > 0 and len(lengths) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [fmt_length(n) for n in lengths])
        ax.minorticks_off()
        _pct_axis(ax)
        ax.set_title(f"task: {task}")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (%)")
    return _finish(fig, path, _title(title, records), handles)


def plot_accuracy_vs_budget(records: list[Record], path: Path, title: str) -> Path:
    """One panel per task: accuracy (%) against measured device memory (% of full KV, mean
    ``device_bytes / full_kv_bytes``), one line per engine/method across its budgets (all lengths
    pooled). ``method == "full"`` is drawn as a horizontal dashed line."""
    tasks = sorted({r["task"] for r in records})
    multi = len(_models(records)) > 1
    line_keys = sorted(_group(records, ("model", "engine", "method")), key=_sort_key)
    style = _style_cycle()
    fig, axes = _figure(len(tasks))
    handles: dict[str, Any] = {}
    for ax, task in zip(axes, tasks):
        by_line = _group([r for r in records if r["task"] == task], ("model", "engine", "method"))
        x_max = 100.0
        for i, key in enumerate(line_keys):
            if key not in by_line:
                continue
            model, engine, method = key
            label = series_label(model, engine, method, None, with_model=multi)
            if method == "full":
                acc = _accuracy(by_line[key])
                line = ax.axhline(acc, linestyle="--", linewidth=1.4, color=style(i)["color"], label=label)
                handles.setdefault(f"{label} KV (reference)", line)
                continue
            points = []
            for (budget,), group in _group(by_line[key], ["budget"]).items():
                x = _device_pct(group)
                if x is not None:
                    points.append((x, _accuracy(group)))
            if not points:
                continue
            points.sort()
            x_max = max(x_max, points[-1][0])
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                              linewidth=1.6, **style(i))
            handles.setdefault(label, line)
        _pct_axis(ax, "y")
        _pct_axis(ax, "x", top=x_max)
        ax.set_title(f"task: {task}")
        ax.set_xlabel("device KV memory (% of full KV, measured)")
        ax.set_ylabel("accuracy (%)")
    return _finish(fig, path, _title(title, records), handles)


def depth_bin(depth: float, n_bins: int = N_DEPTH_BINS) -> int:
    """Bin index of a needle depth in [0, 1] (equal-width bins; 1.0 falls in the last bin)."""
    return int(min(max(int(float(depth) * n_bins), 0), n_bins - 1))


def depth_bin_labels(n_bins: int = N_DEPTH_BINS) -> list[str]:
    """Human labels for :func:`depth_bin`, e.g. ``"0-20%"``."""
    return [f"{100 * i // n_bins}-{100 * (i + 1) // n_bins}%" for i in range(n_bins)]


def depth_grid(records: Sequence[Record], n_bins: int = N_DEPTH_BINS) -> tuple[list[int], np.ndarray]:
    """(sorted lengths, ``n_bins x len(lengths)`` array of mean accuracy %, NaN where empty) over
    the records that have a depth."""
    recs = [r for r in records if r.get("depth") is not None]
    lengths = sorted({r["length"] for r in recs})
    sums = np.zeros((n_bins, len(lengths)))
    counts = np.zeros_like(sums)
    for r in recs:
        b, j = depth_bin(r["depth"], n_bins), lengths.index(r["length"])
        sums[b, j] += 100.0 * float(r["score"])
        counts[b, j] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        grid = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return lengths, grid


def plot_depth_heatmap(records: list[Record], path: Path, title: str) -> Path:
    """Needle-depth heat map: one panel per engine/method/budget, rows = 5 depth bins, columns =
    context lengths, cell = mean accuracy (%), annotated; a shared 0-100 colorbar."""
    recs = [r for r in records if r.get("depth") is not None]
    multi = len(_models(recs)) > 1
    groups = _group(recs, SERIES_KEYS)
    series = sorted(groups, key=_sort_key)
    fig, axes = _figure(max(1, len(series)), panel_w=4.6, panel_h=3.6)
    from matplotlib import colormaps

    cmap = colormaps["RdYlGn"].with_extremes(bad="0.88")  # empty cells in light grey
    image = None
    for ax, s in zip(axes, series):
        lengths, grid = depth_grid(groups[s])
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto")
        for (b, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                ax.text(j, b, f"{value:.0f}", ha="center", va="center", fontsize=8,
                        color="white" if value < 25 or value > 85 else "black")
        ax.set_xticks(range(len(lengths)), [fmt_length(n) for n in lengths])
        ax.set_yticks(range(N_DEPTH_BINS), depth_bin_labels())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        tasks = ", ".join(sorted({r["task"] for r in groups[s]}))
        ax.set_title(f"{series_label(*s, with_model=multi)}\n({tasks})", fontsize="medium")
    if image is not None:
        fig.colorbar(image, ax=axes, label="accuracy (%)", shrink=0.9)
    return _finish(fig, path, _title(title, recs), {})


# --------------------------------------------------------------------------------------------
# report folder

def _needs_budget_plot(records: Sequence[Record]) -> bool:
    budgets = {r.get("budget") for r in records}
    return len(budgets) > 1 or any(r["method"] != "full" and r.get("budget") is not None for r in records)


def turn_section(records: list[Record]) -> list[str]:
    """Markdown lines with accuracy per conversation turn (only when some record is a later turn):
    one row per (engine, method, budget, task, length), one column per turn."""
    if not any(int(r.get("turn") or 0) > 0 for r in records):
        return []
    multi_turn = [r for r in records if r.get("turn") is not None]
    turns = sorted({int(r["turn"]) for r in multi_turn})
    groups = _group(multi_turn, GROUP_KEYS)
    body = []
    for key in sorted(groups, key=_sort_key):
        _, engine, method, budget, task, length = key
        by_turn = _group(groups[key], ["turn"])
        n = len(by_turn.get((turns[0],), []))
        # the n column is the first turn's; a turn asked fewer (or more) times says so in its cell
        cells = [fmt_accuracy(_right(by_turn[(t,)]), len(by_turn[(t,)]), with_n=len(by_turn[(t,)]) != n)
                 if (t,) in by_turn else "-" for t in turns]
        body.append([engine, method, fmt_budget(budget), task, fmt_length(length), str(n), *cells])
    header = ["engine", "method", "budget", "task", "length", "n"] + [f"turn {t + 1} % [95% CI]" for t in turns]
    return ["## Accuracy by conversation turn", "", *_md_table(header, body, right_from=5), ""]


def _paired_by_engine(records: Sequence[Record]) -> dict[tuple, dict[str, Record]]:
    """{(model, method, budget, task, length, sample, seed, turn): {engine: record}}: the same question
    to several engines."""
    pairs: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for r in records:
        key = (r.get("model"), r["method"], r.get("budget"), r["task"], r["length"], r.get("sample"), r.get("seed"),
               r.get("turn"))
        pairs[key][r["engine"]] = r
    return pairs


def engine_agreement(records: Sequence[Record]) -> list[dict]:
    """Engines compared on the questions both answered: one row per (model, method, budget, engine A,
    engine B) with ``n`` questions, ``accuracy_a``/``accuracy_b`` (%) on those questions, ``right_a``/``right_b``
    (sums of scores), ``identical`` (same answer text) and ``same_verdict`` (same score). Empty when no
    question went to two engines."""
    run_order = list(dict.fromkeys(r["engine"] for r in records))
    groups: dict[tuple, list[tuple[Record, Record]]] = defaultdict(list)
    for key, by_engine in _paired_by_engine(records).items():
        engines = sorted(by_engine, key=run_order.index)  # A = the engine the run asked for first
        for i, a in enumerate(engines):
            for b in engines[i + 1:]:
                groups[(key[0], key[1], key[2], a, b)].append((by_engine[a], by_engine[b]))
    rows = []
    def order(key: tuple) -> tuple:  # full KV first, then methods and budgets; engine pairs in run order
        model, method, budget, a, b = key
        return str(model), method != "full", method, _budget_key(budget), run_order.index(a), run_order.index(b)

    for (model, method, budget, a, b), pairs in sorted(groups.items(), key=lambda kv: order(kv[0])):
        rows.append(dict(model=model, method=method, budget=budget, engine_a=a, engine_b=b, n=len(pairs),
                         accuracy_a=_accuracy([p[0] for p in pairs]), accuracy_b=_accuracy([p[1] for p in pairs]),
                         right_a=_right([p[0] for p in pairs]), right_b=_right([p[1] for p in pairs]),
                         identical=sum(p[0].get("prediction") == p[1].get("prediction") for p in pairs),
                         same_verdict=sum(float(p[0]["score"]) == float(p[1]["score"]) for p in pairs)))
    return rows


def agreement_section(records: list[Record]) -> list[str]:
    """Markdown lines comparing engines on the same questions (only when some question went to two)."""
    rows = engine_agreement(records)
    if not rows:
        return []
    body = [[r["method"], fmt_budget(r["budget"]), f"{r['engine_a']} vs {r['engine_b']}", str(r["n"]),
             fmt_accuracy(r["right_a"], r["n"], with_n=False), fmt_accuracy(r["right_b"], r["n"], with_n=False),
             _fmt_num(None if r["accuracy_a"] is None else r["accuracy_b"] - r["accuracy_a"]),
             f"{r['identical']} / {r['n']}", f"{r['same_verdict']} / {r['n']}"] for r in rows]
    # no interval on B - A: the engines answered the same questions, so the two intervals are not
    # independent and their overlap says little; a paired test would be the right tool
    header = ["method", "budget", "engines (A vs B)", "questions", "A % [95% CI]", "B % [95% CI]", "B - A",
              "identical answers", "same verdict"]
    return ["## Engines on the same questions", "", *_md_table(header, body, right_from=3), ""]


def refused_section(refused: list[Record]) -> list[str]:
    """Markdown lines listing the cells a method refused (its budget cannot hold its minimum at that
    length), one row per (engine, method, budget, task, length), with the method's own reason."""
    if not refused:
        return []
    groups = _group(refused, GROUP_KEYS)
    body = [[engine, method, fmt_budget(budget), task, fmt_length(length), str(len(g)), g[0].get("reason", "")]
            for (model, engine, method, budget, task, length), g in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))]
    return ["## Refused cells", "",
            "The method refused these up front (its minimum does not fit the budget at this length); "
            "they are not counted in the accuracy above.", "",
            *_md_table(["engine", "method", "budget", "task", "length", "samples", "reason"], body, right_from=5), ""]


def write_report(results: dict, out_dir: Path, title: str = "sekv-local bench",
                 plots_dir: Path | None = None) -> dict[str, Path]:
    """Write ``summary.md`` and the PNG plots for a ``results.json`` payload into ``out_dir`` (the
    plots into ``plots_dir`` when given; the summary links them by relative path).

    Returns ``{"summary": ..., "accuracy_by_length": ..., ["accuracy_vs_budget": ...],
    ["depth_heatmap": ...]}``; the budget plot is written only when budgets differ (or a
    non-full method has one), the heat map only when some record has a needle depth.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[Record] = list(results.get("records") or [])
    command = (results.get("config") or {}).get("command")
    paths: dict[str, Path] = {}

    lines = [f"# {title}", ""]
    if command:
        cmd = command if isinstance(command, str) else shlex.join(str(c) for c in command)
        lines += ["```bash", cmd, "```", ""]
    if not records:
        lines += ["No records.", ""]
    else:
        lines += [f"Models: {', '.join(_models(records))}. Records: {len(records)}.", ""]
        lines += [markdown_table(summarize(records), title="Summary")]
        plots: list[tuple[str, str, Callable[..., Path]]] = [
            ("accuracy_by_length", "accuracy by context length", plot_accuracy_by_length)]
        if _needs_budget_plot(records):
            plots.append(("accuracy_vs_budget", "accuracy vs device KV budget", plot_accuracy_vs_budget))
        if any(r.get("depth") is not None for r in records):
            plots.append(("depth_heatmap", "accuracy by needle depth", plot_depth_heatmap))
        lines += ["## Plots", ""]
        plot_dir = Path(plots_dir) if plots_dir is not None else out_dir
        for name, caption, plot in plots:
            paths[name] = plot(records, plot_dir / f"{name}.png", f"{title}: {caption}")
            link = Path(os.path.relpath(paths[name], out_dir)).as_posix()
            lines += [f"![{caption[0].upper() + caption[1:]}]({link})", ""]
    lines += turn_section(records)
    lines += agreement_section(records)
    lines += refused_section(results.get("refused") or [])
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return {"summary": summary, **paths}
