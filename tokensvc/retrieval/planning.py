"""What a search asks the store to rank: one `CandidateQuery` built the same way everywhere."""

from __future__ import annotations

from collections.abc import Awaitable

import numpy as np

from tokensvc.retrieval.routing import SearchTuning
from tokensvc.retrieval.text import BM25_B, BM25_K1, or_query, query_words
from tokensvc.storage.records import CandidateQuery

__all__ = ["candidate_query"]


def candidate_query(
    *,
    vector: np.ndarray | None,
    text: str | None,
    k: int,
    rows: int,
    exact: bool,
    neighbours: bool = False,
    text_config: str = "simple",
    tuning: SearchTuning | None = None,
    vector_later: Awaitable[np.ndarray] | None = None,
) -> CandidateQuery:
    """The query of a search: a vector ranker when `vector` is given, a text ranker over the words
    of `text` when it is (`vector_later`: the vector, still being embedded); `rows` is the searched rows' count (BM25's N); `exact` and `tuning` say
    how the vector ranker scans."""
    tuning = tuning or SearchTuning()
    return CandidateQuery(
        vector=vector,
        text=None if text is None else " ".join(query_words(text)),
        or_text=or_query(text or ""),
        text_config=text_config,
        k=k,
        row_count=rows,
        exact=exact,
        neighbours=neighbours,
        bm25_k1=BM25_K1,
        bm25_b=BM25_B,
        ef_search=tuning.ef_search_for(k),
        max_scan_tuples=tuning.max_scan_tuples,
        vector_later=vector_later,
    )
