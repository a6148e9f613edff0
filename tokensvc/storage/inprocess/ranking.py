"""Search candidates over the in-process stores' rows, with the PostgreSQL stores' semantics.

`candidates` is `tokensvc.storage.postgres.ranking` in Python: the vector ranker's top k by inner
product, the text ranker's top k by BM25, their union with both scores, 1-based ranks in each
ranker (0: not among its top k) and, when asked, both scores of each candidate's neighbours.
Ties break by the row's key, as the PostgreSQL statements do (`ORDER BY score DESC, key`).

An in-process search is always exact: `CandidateQuery.exact = False` (an HNSW scan in PostgreSQL,
re-run exactly when short) is answered exactly too, and `ef_search` / `max_scan_tuples` are
ignored.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from tokensvc.storage.inprocess.text import Terms, bm25_scores
from tokensvc.storage.records import Candidate, CandidateQuery

__all__ = ["Searchable", "candidates"]

T = TypeVar("T")


@dataclass(frozen=True)
class Searchable(Generic[T]):
    """One searchable row: what a result carries and how the rankers see it.

    `key` orders tie-breaks (the PostgreSQL key: (bucket, id) or a chunk's primary key);
    neighbours share `partition` and are adjacent in `order`; `local` names a row among them.
    """

    item: T
    key: tuple[Any, ...]
    partition: tuple[Any, ...]
    order: tuple[Any, ...]
    local: Any
    embedding: np.ndarray
    terms: Terms


def candidates(rows: Sequence[Searchable[T]], query: CandidateQuery) -> list[Candidate[T]]:
    """The candidates of `query` among `rows` (already limited to tenant, liveness and filter).

    A plain VECTOR query (no text ranker, no neighbours) returns the vector ranker's candidates
    best first; otherwise the vector ranker's come first in rank order, then the text-only ones.
    """
    if not rows:
        return []
    vector = _vector_scores(rows, query.vector)
    by_vector: list[int] = []
    if vector is not None:
        by_vector = heapq.nsmallest(query.k, range(len(rows)), key=lambda i: (-vector[i], rows[i].key))
    text: dict[int, float] = {}
    by_text: list[int] = []
    if query.text is not None:
        text = bm25_scores(
            [row.terms for row in rows],
            query.text,
            query.or_text,
            row_count=query.row_count,
            k1=query.bm25_k1,
            b=query.bm25_b,
        )
        by_text = heapq.nsmallest(query.k, text, key=lambda i: (-text[i], rows[i].key))
    vector_rank = {i: rank for rank, i in enumerate(by_vector, 1)}
    text_rank = {i: rank for rank, i in enumerate(by_text, 1)}
    links = _neighbours(rows) if query.neighbours else {}

    def scores(i: int) -> tuple[float, float]:
        return (0.0 if vector is None else float(vector[i])), text.get(i, 0.0)

    out: list[Candidate[T]] = []
    for i in dict.fromkeys([*by_vector, *by_text]):
        previous, following = links.get(i, (None, None))
        vector_score, text_score = scores(i)
        out.append(
            Candidate(
                rows[i].item,
                vector_score,
                text_score,
                vector_rank.get(i, 0),
                text_rank.get(i, 0),
                None if previous is None else scores(previous),
                None if following is None else scores(following),
                None if previous is None else rows[previous].local,
                None if following is None else rows[following].local,
            )
        )
    return out


def _vector_scores(rows: Sequence[Searchable[Any]], vector: np.ndarray | None) -> np.ndarray | None:
    """Each row's inner product with the query (cosine: both are unit length), in float64."""
    if vector is None:
        return None
    matrix = np.stack([row.embedding for row in rows]).astype(np.float64)
    scores: np.ndarray = matrix @ np.asarray(vector, dtype=np.float64)
    return scores


def _neighbours(rows: Sequence[Searchable[Any]]) -> dict[int, tuple[int | None, int | None]]:
    """Each row's previous and next row (indexes into `rows`) in its partition's order."""
    partitions: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows):
        partitions.setdefault(row.partition, []).append(i)
    links: dict[int, tuple[int | None, int | None]] = {}
    for members in partitions.values():
        members.sort(key=lambda i: rows[i].order)
        for position, i in enumerate(members):
            previous = members[position - 1] if position > 0 else None
            following = members[position + 1] if position + 1 < len(members) else None
            links[i] = (previous, following)
    return links
