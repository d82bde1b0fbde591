"""RULER string-match scoring.

Both metrics compare case-insensitively and by substring, exactly as RULER does:

* :func:`string_match_all` (RULER's ``string_match_all``) is the *mean* over the references of
  ``ref.lower() in prediction.lower()``: 1.0 only when every reference is present, partial credit
  otherwise (2 of 4 needles found -> 0.5).
* :func:`string_match_part` (RULER's ``string_match_part`` for QA) is 1.0 when any reference is
  present, else 0.0.
"""

from __future__ import annotations

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
