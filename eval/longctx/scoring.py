"""RULER's scores and the log-likelihood ranking score.

Both string metrics are case-insensitive substring tests of each reference in the prediction,
averaged over samples and reported x100: `string_match_all` credits the fraction of references
found, `string_match_part` credits a sample fully if any reference is found.
"""

from __future__ import annotations

import re

_NONPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: drop control characters (they break substring matches)."""
    return _NONPRINTABLE.sub(" ", text).strip()


def _check(preds: list[str], refs: list[list[str]]) -> None:
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")
    if any(len(r) == 0 for r in refs):
        raise ValueError("every sample needs at least one reference")


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    _check(preds, refs)
    if not preds:
        return 0.0
    per = [
        sum(r.lower() in clean_prediction(p).lower() for r in ref) / len(ref)
        for p, ref in zip(preds, refs)
    ]
    return 100.0 * sum(per) / len(per)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    _check(preds, refs)
    if not preds:
        return 0.0
    per = [
        max(float(r.lower() in clean_prediction(p).lower()) for r in ref)
        for p, ref in zip(preds, refs)
    ]
    return 100.0 * sum(per) / len(per)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def rank_credit(scores: list[float], correct: int = 0) -> float:
    """Credit for candidate `correct` having the highest score; ties at the top share the credit.

    Sharing makes an uninformative (constant) scorer land exactly at chance, 1 / len(scores).
    """
    top = max(scores)
    tied = [i for i, s in enumerate(scores) if s == top]
    return 1.0 / len(tied) if correct in tied else 0.0
