"""Abstention: does the best result's score tell a question its store can answer from one it cannot?

Each question is asked twice: where its answer is stored (present) and where it is not (absent);
the score of the best result (0 when there is none) is what a caller would threshold with
`min_score`. The area under the ROC curve of that score, present against absent, is the chance
that a random present question outscores a random absent one (ties count half): 0.5 is no signal,
1.0 a threshold that separates them all. At a threshold: the share of absent questions answered
with nothing (they should be) and of present questions still answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["RECOMMENDED_MIN_SCORE", "auroc", "best_threshold", "operating_point", "summary"]

# The min_score docs/api.md recommends per mode for the default model, judged on absent questions; a
# mode without one is judged at the best threshold of the run itself (an optimistic number, which
# the results say: `threshold_chosen_here`).
RECOMMENDED_MIN_SCORE: dict[str, float] = {"hybrid": 0.8, "vector": 0.8}


def auroc(present: Sequence[float], absent: Sequence[float]) -> float:
    """P(present > absent) + P(tie) / 2 over all pairs (the Mann-Whitney U statistic, scaled);
    every pair compared, which for a benchmark's few thousand questions is instant."""
    if not present or not absent:
        return float("nan")
    p, a = np.asarray(present, float)[:, None], np.asarray(absent, float)[None, :]
    return float(np.mean(p > a) + np.mean(p == a) / 2)


def operating_point(present: Sequence[float], absent: Sequence[float], threshold: float) -> dict[str, float]:
    """With `min_score = threshold`: present questions still answered, absent ones answered with nothing."""
    return {
        "threshold": round(threshold, 4),
        "present_answered": round(float(np.mean(np.asarray(present) >= threshold)), 4),
        "absent_abstained": round(float(np.mean(np.asarray(absent) < threshold)), 4),
    }


def best_threshold(present: Sequence[float], absent: Sequence[float]) -> float:
    """The threshold that maximises present answered + absent abstained (Youden's J), among the
    scores seen; the lowest such one."""
    candidates = sorted(set(present) | set(absent))
    best, best_value = 0.0, -1.0
    for threshold in candidates:
        point = operating_point(present, absent, threshold)
        value = point["present_answered"] + point["absent_abstained"]
        if value > best_value:
            best, best_value = threshold, value
    return best


def summary(
    present: Sequence[float], absent: Sequence[float], threshold: float | None = None
) -> dict[str, Any]:
    """AUROC, the median scores, and the operating point at `threshold` (or the best one here)."""
    chosen = best_threshold(present, absent) if threshold is None else threshold
    return {
        "auroc": round(auroc(present, absent), 4),
        "present_median": round(float(np.median(present)), 4) if present else None,
        "absent_median": round(float(np.median(absent)), 4) if absent else None,
        "absent_at_or_above_present_median": round(
            float(np.mean(np.asarray(absent) >= np.median(present))), 4
        )
        if present and absent
        else None,
        "at_threshold": operating_point(present, absent, chosen),
        "threshold_chosen_here": threshold is None,
        "n_present": len(present),
        "n_absent": len(absent),
    }
