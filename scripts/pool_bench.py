"""Pool the records of several `sekv-local bench` runs (e.g. one per seed) into one summary.

Prints the bench's own summary table over all records, then per (length, task, method) how many
questions were right out of how many, the accuracy with its 95% Wilson score interval, and, against
`--reference` (full KV by default), on how many of the questions both ran one method alone was right:

    python scripts/pool_bench.py docs/bench/gemma_row_16k_seed* docs/bench/gemma_row_32k_seed*

`--alias OLD NEW` counts OLD's records as NEW's, for one setting that ran under two names (e.g. raw
spans as `sekv@rank_gate=false@energy=1.0@max_rank=64` before `sekv@rank_rule=exact` existed). A
question that both names answered counts once, under NEW's record. `--alias-in RUN OLD NEW` renames only
in the folder RUN: one name that meant another setting when RUN was measured (plain `sekv` before a
default changed) while other folders use it for today's.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from sekv_local.eval.report import fmt_accuracy, markdown_table, summarize


def question_key(record: dict) -> tuple:
    return record["length"], record["task"], record["seed"], record["sample"], record["turn"]


def pool_records(runs: list[Path], aliases: dict[str, str],
                 run_aliases: dict[Path, dict[str, str]] | None = None) -> list[dict]:
    """All records of `runs`, renamed by `run_aliases` (per folder), then by `aliases`; a question NEW
    already answered is not counted again."""
    records, seen = [], set()
    local = {Path(run).resolve(): names for run, names in (run_aliases or {}).items()}
    unknown = set(local) - {Path(run).resolve() for run in runs}
    if unknown:
        raise SystemExit(f"--alias-in names folders that are not pooled: {', '.join(map(str, sorted(unknown)))}")
    raw = [{**r, "method": local.get(run.resolve(), {}).get(r["method"], r["method"])}
           for run in runs for r in json.loads((run / "results.json").read_text())["records"]]
    # NEW's own records first, so a question both names ran keeps NEW's answer
    for r in sorted(raw, key=lambda r: r["method"] in aliases):
        r = {**r, "method": aliases.get(r["method"], r["method"])}
        key = (r["method"], r["budget"], r["engine"], r["model"], *question_key(r))
        if key not in seen:
            seen.add(key)
            records.append(r)
    return records


def label(record: dict) -> str:
    """The method, with its budget when it has one: one row per (method, budget)."""
    return record["method"] if record["budget"] is None else f"{record['method']} {record['budget']:.1%}"


def length_group(length: int) -> str:
    """16,000 and 16,384 tokens are one row ("16K"): seeds ran at either."""
    return f"{round(length / 1000)}K"


def fmt_right(right: float) -> str:
    """A sum of scores as a count: ``"3"``, or ``"2.5"`` when partial credit left a fraction."""
    return str(round(right)) if abs(right - round(right)) < 1e-6 else f"{right:.2f}".rstrip("0").rstrip(".")


def compare(records: list[dict], reference: str) -> list[tuple[str, str, str, float, int, int | None, int | None]]:
    """Per (length group, task, method): right (the sum of the scores, so partial credit counts as its
    fraction), asked, and on the questions both ran, how many this method alone got right and how many
    `reference` alone got right (None for the reference itself)."""
    score: dict[str, dict[tuple, float]] = defaultdict(dict)
    for r in records:
        score[label(r)][question_key(r)] = r["score"]
    ref = score.get(reference, {})
    rows = []
    cells = sorted({(length_group(k[0]), k[1]) for s in score.values() for k in s},
                   key=lambda c: (int(c[0][:-1]), c[1]))
    for group, task in cells:
        for method in sorted(score, key=lambda m: (m != reference, m)):
            mine = {k: v for k, v in score[method].items() if (length_group(k[0]), k[1]) == (group, task)}
            if not mine:
                continue
            both = [k for k in mine if k in ref]
            alone = (None, None) if method == reference else \
                (sum(mine[k] > ref[k] for k in both), sum(ref[k] > mine[k] for k in both))
            rows.append((group, task, method, float(sum(mine.values())), len(mine), *alone))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench output folders (each with results.json)")
    ap.add_argument("--reference", default="full", help="method the others are compared with")
    ap.add_argument("--alias", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="count method OLD's records as NEW's (repeatable)")
    ap.add_argument("--alias-in", nargs=3, action="append", default=[], metavar=("RUN", "OLD", "NEW"),
                    help="the same, only in the folder RUN (repeatable)")
    args = ap.parse_args()
    run_aliases: dict[Path, dict[str, str]] = {}
    for run, old, new in args.alias_in:
        run_aliases.setdefault(Path(run), {})[old] = new
    records = pool_records(args.runs, dict(args.alias), run_aliases)
    print(markdown_table(summarize(records), title=f"{len(records)} records from {len(args.runs)} runs"))
    print("\n| length | task | method | right | accuracy % [95% CI] | only this right | only reference right |")
    print("|---|---|---|---:|---:|---:|---:|")
    for group, task, method, right, asked, mine, ref in compare(records, args.reference):
        accuracy = fmt_accuracy(right, asked, with_n=False)
        print(f"| {group} | {task} | {method} | {fmt_right(right)}/{asked} | {accuracy} | "
              f"{'-' if mine is None else mine} | {'-' if ref is None else ref} |")


if __name__ == "__main__":
    main()
