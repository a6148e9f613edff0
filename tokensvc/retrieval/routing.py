"""How a search reads its rows: an exact scan of the bucket (or corpus) or the HNSW index.

Small buckets (a few thousand rows) are faster and exact with a plain scan of the bucket's rows;
large ones use pgvector's HNSW index with 0.8's iterative scan, so a filtered search still finds
k rows. An approximate search that comes back short is re-run exactly in the same transaction
(the stores do it), so results are always complete: min(k, matching rows).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HNSW_MAX_DIMENSION", "SearchTuning"]

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
