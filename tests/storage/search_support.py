"""Search calls for storage tests, through the store port's one `search` method."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokensvc.retrieval import SearchTuning, candidate_query
from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ports import MemoryStore
from tokensvc.storage.postgres.memories import search_statement
from tokensvc.storage.records import Candidate, CandidateQuery, MemoryRecord, Tenant

__all__ = [
    "EmbeddedLater",
    "ScoredMemory",
    "bucket_size",
    "search_candidates",
    "vector_query",
    "vector_search",
    "vector_sql",
]


class EmbeddedLater:
    """A query's vector still being embedded (`CandidateQuery.vector_later`): notes when the store
    starts waiting for it; the test sets `vector`'s result."""

    def __init__(self) -> None:
        self.awaited = asyncio.Event()
        self.vector: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()

    def __await__(self) -> Generator[Any, None, np.ndarray]:
        self.awaited.set()
        return self.vector.__await__()


@dataclass(frozen=True)
class ScoredMemory:
    memory: MemoryRecord
    score: float


def vector_query(
    query: np.ndarray, *, k: int, exact: bool, ef_search: int = 40, max_scan_tuples: int = 20_000
) -> CandidateQuery:
    """A plain VECTOR query (no text ranker, no neighbours)."""
    tuning = SearchTuning(ef_search=ef_search, max_scan_tuples=max_scan_tuples)
    return candidate_query(vector=query, text=None, k=k, rows=0, exact=exact, tuning=tuning)


async def search_candidates(
    store: MemoryStore,
    tenant: Tenant,
    bucket: str,
    query: CandidateQuery,
    *,
    filter_: Filter | None,
    embedder: str,
) -> list[Candidate[MemoryRecord]]:
    """The candidates of `query` with its row count given (no counting)."""
    outcome = await store.search(
        tenant,
        bucket,
        lambda _rows: query,
        row_count=query.row_count,
        count_cap=1,
        filter_=filter_,
        embedder=embedder,
    )
    assert outcome.row_count == query.row_count
    return outcome.candidates


async def vector_search(
    store: MemoryStore,
    tenant: Tenant,
    bucket: str,
    query: np.ndarray,
    *,
    k: int,
    filter_: Filter | None,
    exact: bool,
    embedder: str,
    ef_search: int = 40,
    max_scan_tuples: int = 20_000,
) -> list[ScoredMemory]:
    """The true top k by inner product when `exact`, else via HNSW (complete either way)."""
    wanted = vector_query(query, k=k, exact=exact, ef_search=ef_search, max_scan_tuples=max_scan_tuples)
    found = await search_candidates(store, tenant, bucket, wanted, filter_=filter_, embedder=embedder)
    return [ScoredMemory(c.item, c.vector_score) for c in found]


async def bucket_size(store: MemoryStore, tenant: Tenant, bucket: str, cap: int) -> int:
    """The bucket's row count up to `cap`, as a search with no known count measures it."""
    seen: list[int] = []

    def plan(rows: int) -> CandidateQuery:
        seen.append(rows)
        return candidate_query(vector=None, text="count", k=1, rows=rows, exact=True)

    outcome = await store.search(
        tenant, bucket, plan, row_count=None, count_cap=cap, filter_=None, embedder=""
    )
    assert seen == [outcome.row_count]
    return outcome.row_count


def vector_sql(
    bucket: str, query: np.ndarray, *, k: int, filter_: Filter | None, exact: bool, **scan: Any
) -> tuple[str, list[Any], dict[str, str] | None]:
    """Exactly the statement, parameters and settings the store runs for a VECTOR search."""
    return search_statement(bucket, vector_query(query, k=k, exact=exact, **scan), filter_)
