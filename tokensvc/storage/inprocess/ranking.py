"""Search candidates over the in-process stores' rows, with the PostgreSQL stores' semantics.

`candidates` scores the text ranker with the in-process BM25 (`tokensvc.storage.inprocess.text`)
and leaves the rest to `tokensvc.storage.scoring.candidates`, the PostgreSQL candidate statement in
Python. An in-process search is always exact: `CandidateQuery.exact = False` (an HNSW scan in
PostgreSQL, re-run exactly when short) is answered exactly too, and `ef_search` /
`max_scan_tuples` are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from tokensvc.storage.inprocess.text import bm25_ideal, bm25_scores
from tokensvc.storage.records import Candidate, CandidateQuery
from tokensvc.storage.scoring import Searchable, top_by_text
from tokensvc.storage.scoring import candidates as scored_candidates

__all__ = ["Searchable", "candidates"]

T = TypeVar("T")


def candidates(rows: Sequence[Searchable[T]], query: CandidateQuery) -> list[Candidate[T]]:
    """The candidates of `query` among `rows` (already limited to tenant, liveness and filter)."""
    text = None
    if query.text is not None and rows:
        terms = [row.terms for row in rows]
        row_count, k1 = query.row_count, query.bm25_k1
        scores = bm25_scores(terms, query.text, query.or_text, row_count=row_count, k1=k1, b=query.bm25_b)
        ideal = bm25_ideal(terms, query.text, query.or_text, row_count=row_count, k1=k1)
        text = top_by_text(rows, scores, query.k, ideal)
    return scored_candidates(rows, query, text)
