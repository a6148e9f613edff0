"""How a search reads its rows: an exact scan of the bucket (or corpus) or the HNSW index.

Small buckets (a few thousand rows) are faster and exact with a plain scan of the bucket's rows;
large ones use pgvector's HNSW index with 0.8's iterative scan, so a filtered search still finds
k rows. An approximate search that comes back short is re-run exactly in the same transaction
(the stores do it), so results are always complete: min(k, matching rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["HNSW_MAX_DIMENSION", "Recent", "RowCounts", "SearchTuning"]

T = TypeVar("T")

HNSW_MAX_DIMENSION = 2000  # HNSW on `vector` indexes at most 2,000 dimensions


@dataclass(frozen=True)
class SearchTuning:
    """Knobs measured by the benchmarks (docs/benchmarks.md)."""

    exact_threshold: int = 1000
    ef_search: int = 100
    max_scan_tuples: int = 20_000
    # Rows each ranker contributes to a HYBRID or TEXT search before fusion.
    candidates: int = 50
    # A filtered search reads this many times more rows exactly before it takes the HNSW index: a
    # filter makes an approximate scan visit 1/selectivity more tuples per hit, while the exact
    # scan computes distances for matching rows only.
    filtered_exact_factor: int = 4
    # How long a bucket's row count (which routes searches and sizes BM25's idf) is reused.
    row_count_ttl_seconds: float = 30.0

    @property
    def count_cap(self) -> int:
        """Row counts are counted up to this: enough to route and to weigh terms."""
        return self.exact_threshold * self.filtered_exact_factor + 1

    def exact(self, rows: int, *, filtered: bool, dimension: int) -> bool:
        """Whether this many rows are searched exactly (else by HNSW, exact if it comes back short)."""
        if dimension > HNSW_MAX_DIMENSION:
            return True
        threshold = self.exact_threshold * (self.filtered_exact_factor if filtered else 1)
        return rows <= threshold

    def ef_search_for(self, k: int) -> int:
        """The approximate scan's candidate list for k candidates (at least 2 k)."""
        return max(self.ef_search, 2 * k)


class Recent(Generic[T]):
    """Values kept for `ttl` seconds (at most `capacity`, the oldest dropped first)."""

    def __init__(self, ttl: float, capacity: int = 100_000):
        self._ttl = ttl
        self._capacity = capacity
        self._entries: dict[str, tuple[T, float]] = {}

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    def put(self, key: str, value: T) -> None:
        if len(self._entries) >= self._capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (value, time.monotonic() + self._ttl)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()


class RowCounts(Recent[int]):
    """Row counts of buckets or corpora (capped), reused for a while: they route searches and weigh
    BM25 terms, never decide results.

    A stale count costs speed, never completeness: a grown bucket searched exactly is still exact,
    and a shrunk one searched by HNSW falls back to an exact scan when the approximate one is short.
    Writes made by this process adjust the count at once; other replicas' after the TTL.
    """

    def grew(self, key: str, rows: int) -> None:
        if (entry := self._entries.get(key)) is not None:
            self._entries[key] = (max(0, entry[0] + rows), entry[1])
