"""Pool the records of several `sekv-local bench` runs (e.g. one per seed) into one summary.

Prints the bench's own summary table over all records, then per (length, task, method) how many
questions were right out of how many, and, against `--reference` (full KV by default), on how many of
the questions both ran one method alone was right:

    python scripts/pool_bench.py docs/bench/gemma_row_16k_seed* docs/bench/gemma_row_32k_seed*
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from sekv_local.eval.report import fmt_length, markdown_table, summarize


def question_key(record: dict) -> tuple:
    return record["length"], record["task"], record["seed"], record["sample"], record["turn"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench output folders (each with results.json)")
    ap.add_argument("--reference", default="full", help="method the others are compared with")
    args = ap.parse_args()
    records = []
    for run in args.runs:
        records += json.loads((run / "results.json").read_text())["records"]
    print(markdown_table(summarize(records), title=f"{len(records)} records from {len(args.runs)} runs"))

    score: dict[str, dict[tuple, float]] = defaultdict(dict)
    for r in records:
        score[r["method"]][question_key(r)] = r["score"]
    reference = score.get(args.reference, {})
    print("\n| length | task | method | right | only this right | only reference right |")
    print("|---|---|---|---:|---:|---:|")
    cells = sorted({(k[0], k[1]) for s in score.values() for k in s})
    for length, task in cells:
        for method in sorted(score, key=lambda m: (m != args.reference, m)):
            mine = {k: v for k, v in score[method].items() if k[:2] == (length, task)}
            if not mine:
                continue
            both = [k for k in mine if k in reference]
            only_mine = sum(mine[k] > reference[k] for k in both)
            only_ref = sum(reference[k] > mine[k] for k in both)
            print(f"| {fmt_length(length)} | {task} | {method} | {sum(mine.values()):g}/{len(mine)} | "
                  f"{only_mine if method != args.reference else '-'} | {only_ref if method != args.reference else '-'} |")


if __name__ == "__main__":
    main()
