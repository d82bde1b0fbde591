"""The document map's arithmetic: where the last answer zoomed in, binned over a strip of cells.

Pure functions (no Textual) so they can be tested on their own. A zoomed span is a dict with
``doc_token`` (offset in the document), ``length`` (tokens) and ``hits`` (how many layer/head/step
picks it got), as in ``Session.answers[-1].observations["zoomed"]``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

#: characters for no hits, a trace, and increasing heat
SHADES = "░░▒▓█"
#: a cell with fewer than this share of the hottest cell's hits is a trace: a routed slot now and then over
#: the answer, not a place the answer came from (with question-time pins most cells get a few such hits)
TRACE = 1 / 16


def bin_span(index: int, doc_tokens: int, n_bins: int) -> tuple[int, int]:
    """Token range [start, end) of bin `index` when `doc_tokens` tokens are spread over `n_bins` cells."""
    if n_bins <= 0 or doc_tokens <= 0:
        return 0, 0
    index = min(max(index, 0), n_bins - 1)
    start = index * doc_tokens // n_bins
    end = (index + 1) * doc_tokens // n_bins
    return start, max(end, min(start + 1, doc_tokens))


def bin_of(token: int, doc_tokens: int, n_bins: int) -> int:
    """The cell that holds document token `token`."""
    if n_bins <= 0 or doc_tokens <= 0:
        return 0
    token = min(max(token, 0), doc_tokens - 1)
    # the last cell whose span starts at or before `token` (consistent with bin_span's floors)
    return min(n_bins - 1, ((token + 1) * n_bins + doc_tokens - 1) // doc_tokens - 1)


def bin_hits(zoomed: Iterable[dict[str, Any]], doc_tokens: int, n_bins: int) -> list[float]:
    """Hits per cell: each span's hits are shared among the cells it overlaps, by overlap."""
    values = [0.0] * max(n_bins, 0)
    if n_bins <= 0 or doc_tokens <= 0:
        return values
    for z in zoomed:
        start = max(0, int(z.get("doc_token", 0)))
        length = max(1, int(z.get("length", 1)))
        end = min(doc_tokens, start + length)
        if end <= start:
            continue
        hits = float(z.get("hits", 1))
        for b in range(bin_of(start, doc_tokens, n_bins), bin_of(end - 1, doc_tokens, n_bins) + 1):
            b0, b1 = bin_span(b, doc_tokens, n_bins)
            overlap = min(end, b1) - max(start, b0)
            if overlap > 0:
                values[b] += hits * overlap / (end - start)
    return values


def levels(values: Sequence[float], n_levels: int = len(SHADES) - 1) -> list[int]:
    """0 for cells without hits, 1 for a trace (under TRACE of the hottest cell), else 2..n_levels scaled to
    the hottest cell."""
    top = max(values, default=0.0)
    if top <= 0:
        return [0] * len(values)
    heat = n_levels - 1
    return [0 if v <= 0 else 1 if v < TRACE * top else 1 + max(1, min(heat, math.ceil(heat * v / top)))
            for v in values]


def spans_in(zoomed: Iterable[dict[str, Any]], start: int, end: int) -> list[dict[str, Any]]:
    """Zoomed spans that overlap document tokens [start, end), most hits first."""
    found = [z for z in zoomed
             if int(z.get("doc_token", 0)) < end and int(z.get("doc_token", 0)) + max(1, int(z.get("length", 1))) > start]
    return sorted(found, key=lambda z: (-z.get("hits", 0), z.get("doc_token", 0)))


def hottest_bin(values: Sequence[float]) -> int | None:
    """Index of the cell with the most hits (the first one on ties), None when nothing was hit."""
    if not values or max(values) <= 0:
        return None
    return max(range(len(values)), key=lambda i: (values[i], -i))
