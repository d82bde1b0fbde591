"""RULER string-match scoring.

Both metrics compare case-insensitively and by substring, exactly as RULER does:

* :func:`string_match_all` (RULER's ``string_match_all``) is the *mean* over the references of
  ``ref.lower() in prediction.lower()``: 1.0 only when every reference is present, partial credit
  otherwise (2 of 4 needles found -> 0.5).
* :func:`string_match_part` (RULER's ``string_match_part`` for QA) is 1.0 when any reference is
  present, else 0.0.

:func:`wilson_interval` gives the 95% Wilson score interval of an accuracy, which the bench reports
next to every accuracy: with a few dozen questions per cell the sampling error is large, and the Wilson
interval (unlike the normal approximation) stays inside [0, 1] and is sensible at 0 or n right.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tasks import Question


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of ``references`` found in ``prediction`` (case-insensitive substring).

    RULER averages over the references, so the score is 1.0 only when all are present. An empty
    reference list scores 0.0 (nothing can be verified)."""
    if not references:
        return 0.0
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference occurs in ``prediction`` (case-insensitive substring), else 0.0."""
    pred = prediction.lower()
    return 1.0 if any(ref.lower() in pred for ref in references) else 0.0


def score(prediction: str, question: Question) -> float:
    """Score ``prediction`` against ``question.answers`` with the metric named by ``question.match``
    (``"all"`` -> :func:`string_match_all`, ``"part"`` -> :func:`string_match_part`)."""
    if question.match == "all":
        return string_match_all(prediction, question.answers)
    if question.match == "part":
        return string_match_part(prediction, question.answers)
    raise ValueError(f"unknown match kind {question.match!r} (expected 'all' or 'part')")


def wilson_interval(right: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval ``(low, high)``, as fractions in [0, 1], for ``right`` successes of ``n``.

    ``right`` is the *sum of the per-question scores*, not a count of fully right answers: a
    question scored by :func:`string_match_all` can earn partial credit (2 of 4 needles -> 0.5), and
    its score is added as it is. The interval then treats the mean score as the proportion, which is
    exact for 0/1 scores and a close approximation for fractional ones (partial credit only lowers
    the per-question variance, so the interval is, if anything, slightly conservative).

    ``z`` is the standard normal quantile of the two-sided level (1.959964 -> 95%). With ``n == 0``
    nothing is known and the interval is ``(0.0, 1.0)``.

    Raises ``ValueError`` for a negative ``n``, a non-positive ``z`` or ``right`` outside ``[0, n]``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not z > 0:
        raise ValueError(f"z must be > 0, got {z}")
    if n == 0:
        return 0.0, 1.0
    # summed float scores (e.g. 1/3 + 1/3 + 1/3) can land a hair outside [0, n]
    eps = 1e-9 * n
    if not -eps <= right <= n + eps:
        raise ValueError(f"right must lie in [0, n={n}], got {right}")
    p = min(max(right / n, 0.0), 1.0)
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    # at p = 0 (p = 1) the low (high) bound is exactly 0 (1); rounding would leave it a hair off
    low = 0.0 if p == 0.0 else max(0.0, center - half)
    high = 1.0 if p == 1.0 else min(1.0, center + half)
    return low, high
