"""Search candidates ranked in Python over rows read whole, with the PostgreSQL statements' semantics.

`candidates` is the candidate statement of `tokensvc.storage.postgres.ranking` in Python: the
vector ranker's top k by inner product, the text ranker's top k (scored by the caller), their
union with both scores, 1-based ranks in each ranker (0: not among its top k) and, when asked,
both scores of each candidate's neighbours (the rows one and two places before and after it in
its partition, among `rows`).
Ties break by the row's key, as the statements do (`ORDER BY score DESC, key`).

Two callers: the in-process stores, for every search (their BM25 is `tokensvc.storage.inprocess.text`),
and the PostgreSQL stores for a small exact HYBRID search that read its rows, vectors and BM25
scores in one statement while its query was embedded (`ranking.fetch_candidates`). Vector scores
are computed in float64 here and in float32 by pgvector: they agree to about 1e-7.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from tokensvc.storage.records import Candidate, CandidateQuery

__all__ = ["RowSet", "Searchable", "TextRanking", "candidates", "top_by_text"]

T = TypeVar("T")


@dataclass(frozen=True)
class Searchable(Generic[T]):
    """One searchable row: what a result carries and how the rankers see it.

    `key` orders tie-breaks (the PostgreSQL key: (bucket, id) or a chunk's primary key);
    neighbours share `partition` and are adjacent in `order`; `local` names a row among them;
    `terms` (in-process stores only) its lexemes and their counts.
    """

    item: T
    key: tuple[Any, ...]
    partition: tuple[Any, ...]
    order: tuple[Any, ...]
    local: Any
    embedding: np.ndarray
    terms: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TextRanking:
    """The text ranker over `rows`: BM25 of each row the query matches (by index into the rows),
    and its top k, best first."""

    scores: Mapping[int, float]
    top: Sequence[int]
    ideal: float | None = None  # the BM25 score no row reaches (`Candidate.text_ideal`)


def top_by_text(
    rows: Sequence[Searchable[Any]], scores: Mapping[int, float], k: int, ideal: float | None = None
) -> TextRanking:
    """The text ranker's top k of `scores`, ties broken by key."""
    return TextRanking(scores, heapq.nsmallest(k, scores, key=lambda i: (-scores[i], rows[i].key)), ideal)


def candidates(
    rows: Sequence[Searchable[T]], query: CandidateQuery, text: TextRanking | None
) -> list[Candidate[T]]:
    """The candidates of `query` among `rows` (already limited to tenant, liveness and filter);
    `text`: the text ranker's scores when the query has one.

    A plain VECTOR query (no text ranker, no neighbours) returns the vector ranker's candidates
    best first; otherwise the vector ranker's come first in rank order, then the text-only ones.
    """
    return RowSet(rows, text, neighbours=query.neighbours).candidates(query)


class RowSet(Generic[T]):
    """Rows read whole, prepared for ranking before the query's vector is known: their vectors as
    one matrix, their order by key (tie-breaks) and, when asked, each row's neighbours."""

    def __init__(self, rows: Sequence[Searchable[T]], text: TextRanking | None, *, neighbours: bool) -> None:
        self.rows = rows
        self.text = text
        self._matrix = (
            np.stack([row.embedding for row in rows]).astype(np.float64) if rows else np.zeros((0, 0))
        )
        by_key = sorted(range(len(rows)), key=lambda i: rows[i].key)
        self._key_rank = np.empty(len(rows), dtype=np.int64)
        self._key_rank[by_key] = np.arange(len(rows))
        self._links = _neighbours(rows) if neighbours else {}

    def candidates(self, query: CandidateQuery) -> list[Candidate[T]]:
        """The candidates of `query` (its vector, k and neighbours; the text ranker is `text`)."""
        rows = self.rows
        if not rows:
            return []
        vector = None
        by_vector: list[int] = []
        if query.vector is not None:
            # Each row's inner product with the query (cosine: both are unit length), in float64.
            vector = self._matrix @ np.asarray(query.vector, dtype=np.float64)
            by_vector = np.lexsort((self._key_rank, -vector))[: query.k].tolist()
        scores: Mapping[int, float] = {} if self.text is None else self.text.scores
        by_text: Sequence[int] = () if self.text is None else self.text.top
        vector_rank = {i: rank for rank, i in enumerate(by_vector, 1)}
        text_rank = {i: rank for rank, i in enumerate(by_text, 1)}
        links = self._links if query.neighbours else {}

        def both(i: int) -> tuple[float, float]:
            return (0.0 if vector is None else float(vector[i])), scores.get(i, 0.0)

        def scores_of(i: int | None) -> tuple[float, float] | None:
            return None if i is None else both(i)

        def local_of(i: int | None) -> Any:
            return None if i is None else rows[i].local

        out: list[Candidate[T]] = []
        for i in dict.fromkeys([*by_vector, *by_text]):
            previous, following, second_previous, second_next = links.get(i, (None, None, None, None))
            vector_score, text_score = both(i)
            out.append(
                Candidate(
                    rows[i].item,
                    vector_score,
                    text_score,
                    vector_rank.get(i, 0),
                    text_rank.get(i, 0),
                    scores_of(previous),
                    scores_of(following),
                    local_of(previous),
                    local_of(following),
                    scores_of(second_previous),
                    scores_of(second_next),
                    local_of(second_previous),
                    local_of(second_next),
                    None if self.text is None else self.text.ideal,
                )
            )
        return out


_Links = tuple[int | None, int | None, int | None, int | None]


def _neighbours(rows: Sequence[Searchable[Any]]) -> dict[int, _Links]:
    """Each row's neighbours (indexes into `rows`) in its partition's order: the previous and next
    row, then the rows two places before and after."""
    partitions: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows):
        partitions.setdefault(row.partition, []).append(i)
    links: dict[int, _Links] = {}
    for members in partitions.values():
        members.sort(key=lambda i: rows[i].order)
        padded = [None, None, *members, None, None]
        for position, i in enumerate(members, 2):
            links[i] = (
                padded[position - 1],
                padded[position + 1],
                padded[position - 2],
                padded[position + 2],
            )
    return links
