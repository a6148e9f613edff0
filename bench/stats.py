"""Latency summaries shared by the benchmark scripts."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

__all__ = ["latency_summary", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (no interpolation); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, int(np.ceil(q / 100 * len(ordered))) - 1))
    return ordered[index]


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean in milliseconds (the values are), and the count."""
    return {
        "p50_ms": round(percentile(values, 50), 3),
        "p99_ms": round(percentile(values, 99), 3),
        "mean_ms": round(statistics.fmean(values), 3) if values else float("nan"),
        "n": len(values),
    }
