"""Search quality against numpy: the exact path is exact, the HNSW path is complete and accurate.

Clustered unit vectors (seeded, so every run sees the same data) in two buckets that share the
table: 2,000 rows searched exactly, 5,000 rows searched through HNSW with a filter that matches
about 3% of them. Expected results are computed in numpy (float64) over the rows the filter
matches, using the filter language's own Python evaluator.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import numpy as np
import pytest

from tests.storage.search_support import (
    ScoredMemory,
    vector_search,
    vector_sql,
)
from tests.support import SharedDatabase, service_settings
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.memory import Condition, Filter, Operator, matches
from tokensvc.memory.models import NewMemory
from tokensvc.retrieval import SearchTuning
from tokensvc.storage.postgres.database import _init_connection
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import Tenant

DIM = 384
CLUSTERS = 24
BATCH = 256
K = 10
TUNING = SearchTuning()  # the service's defaults
RARE = Condition("rare", Operator.EQ, True)


@dataclass(frozen=True)
class Corpus:
    tenant: Tenant
    bucket: str
    ids: list[str]
    vectors: np.ndarray  # (n, DIM) float32, unit rows, in `ids` order
    metadata: list[dict[str, Any]]
    queries: np.ndarray

    def expected(self, query: np.ndarray, k: int, filter_: Filter | None) -> list[tuple[str, float]]:
        """Exact top-k (id, inner product) among matching rows, best first."""
        keep = np.array([filter_ is None or matches(filter_, m) for m in self.metadata])
        index = np.flatnonzero(keep)
        scores = self.vectors[index].astype(np.float64) @ query.astype(np.float64)
        order = np.argsort(-scores, kind="stable")[:k]
        return [(self.ids[index[i]], float(scores[i])) for i in order]

    def score(self, memory_id: str, query: np.ndarray) -> float:
        return float(self.vectors[self.ids.index(memory_id)].astype(np.float64) @ query.astype(np.float64))


def clustered(rng: np.random.Generator, centers: np.ndarray, count: int) -> np.ndarray:
    labels = rng.integers(0, len(centers), count)
    points = centers[labels] + rng.standard_normal((count, DIM)) * (0.9 / np.sqrt(DIM))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


async def build_corpus(
    store: PostgresMemoryStore,
    rng: np.random.Generator,
    centers: np.ndarray,
    count: int,
    label: str,
    metadata_of: Any,
) -> Corpus:
    bucket = "v1." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")
    tenant = Tenant("recall-tests", f"{label}-{uuid.uuid4().hex[:8]}", (bucket,))
    vectors = clustered(rng, centers, count)
    metadata = [metadata_of(i) for i in range(count)]
    ids = [str(uuid.uuid4()) for _ in range(count)]
    for start in range(0, count, BATCH):
        rows = []
        for i in range(start, min(count, start + BATCH)):
            content = f"{label} memory {i} in {bucket}"
            rows.append(
                NewMemory(
                    id=ids[i],
                    content=content,
                    content_sha256=hashlib.sha256(content.encode()).digest(),
                    metadata=metadata[i],
                    idempotency_key=None,
                    ttl_seconds=None,
                    embedding=vectors[i],
                )
            )
        refs = await store.insert(tenant, bucket, rows)
        assert all(ref.inserted for ref in refs)
    return Corpus(tenant, bucket, ids, vectors, metadata, clustered(rng, centers, 20))


@pytest.fixture(scope="module")
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    """The serving role's pool, opened the way the service opens it."""
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("recall")))
    try:
        yield await db.open_pool()
    finally:
        await db.close()


@pytest.fixture(scope="module")
async def index_pool(database: SharedDatabase) -> AsyncIterator[asyncpg.Pool]:
    """The serving role with `enable_sort = off`: the planner takes the HNSW index whenever it can.

    Which plan PostgreSQL picks for a filtered search depends on table statistics (a selective
    filter often makes "scan the bucket, then sort" cheaper, and that plan is exact). To test the
    iterative index scan itself, this pool makes the index the only plan without a sort.
    """
    credential = FileCredentialSource(database.app_credential_dir).read()
    pool = await asyncpg.create_pool(
        database.dsn,
        user=credential.username,
        password=credential.password,
        min_size=1,
        max_size=2,
        init=_init_connection,
        server_settings={"search_path": "tokensvc, public", "enable_sort": "off"},
    )
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture(scope="module")
async def corpora(pool: asyncpg.Pool) -> tuple[Corpus, Corpus]:
    """(small: 2,000 rows, large: 5,000 rows with 3% `rare`), sharing the table and its clusters."""
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((CLUSTERS, DIM))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    store = PostgresMemoryStore(pool)
    small = await build_corpus(
        store, rng, centers, 2000, "small", lambda i: {"n": i, "tag": "abc"[i % 3], "half": i % 2 == 0}
    )
    large = await build_corpus(store, rng, centers, 5000, "large", lambda i: {"n": i, "rare": i % 33 == 0})
    return small, large


def assert_same_ranking(
    corpus: Corpus, query: np.ndarray, got: Sequence[ScoredMemory], k: int, f: Filter | None
) -> None:
    want = corpus.expected(query, k, f)
    assert len(got) == len(want)
    for hit, (want_id, want_score) in zip(got, want, strict=True):
        assert hit.score == pytest.approx(want_score, abs=1e-5)
        if hit.memory.id != want_id:  # only a tie (within float32 rounding) may swap places
            assert corpus.score(hit.memory.id, query) == pytest.approx(want_score, abs=1e-6)
    assert len({hit.memory.id for hit in got}) == len(got)


def recall(corpus: Corpus, query: np.ndarray, got: Sequence[ScoredMemory], k: int, f: Filter | None) -> float:
    want = {memory_id for memory_id, _ in corpus.expected(query, k, f)}
    return len(want & {hit.memory.id for hit in got}) / len(want)


async def search(
    store: PostgresMemoryStore, corpus: Corpus, query: np.ndarray, *, k: int, f: Filter | None, exact: bool
) -> list[ScoredMemory]:
    return await vector_search(
        store,
        corpus.tenant,
        corpus.bucket,
        query,
        k=k,
        filter_=f,
        exact=exact,
        ef_search=max(TUNING.ef_search, 2 * k),
        max_scan_tuples=TUNING.max_scan_tuples,
        embedder="test",
    )


@pytest.mark.parametrize(
    "filter_",
    [
        None,
        Condition("tag", Operator.EQ, "b"),
        Condition("n", Operator.LT, 150),  # 7.5%: the top-k reach far from the query
    ],
    ids=["no-filter", "tag-eq", "n-lt"],
)
async def test_exact_search_is_numpys_exact_top_k(
    pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus], filter_: Filter | None
) -> None:
    small, _ = corpora
    store = PostgresMemoryStore(pool)
    for query in small.queries:
        hits = await search(store, small, query, k=K, f=filter_, exact=True)
        assert_same_ranking(small, query, hits, K, filter_)
        assert all(filter_ is None or matches(filter_, hit.memory.metadata) for hit in hits)


async def test_exact_search_returns_every_match_when_fewer_than_k(
    pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    small, _ = corpora
    few = Condition("n", Operator.IN, values=(3, 1500, 1999, 5000))  # 5000 matches no row
    hits = await search(PostgresMemoryStore(pool), small, small.queries[0], k=K, f=few, exact=True)
    assert sorted(hit.memory.id for hit in hits) == sorted(small.ids[i] for i in (3, 1500, 1999))
    assert_same_ranking(small, small.queries[0], hits, K, few)


async def test_the_filtered_search_under_test_is_an_hnsw_index_scan(
    index_pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    _, large = corpora
    sql, params, settings = vector_sql(
        large.bucket,
        large.queries[0],
        k=K,
        filter_=RARE,
        exact=False,
        ef_search=TUNING.ef_search_for(K),
        max_scan_tuples=TUNING.max_scan_tuples,
    )
    async with tenant_transaction(index_pool, large.tenant, settings=settings) as conn:
        plan = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params)
    text = json.dumps(plan if isinstance(plan, list) else json.loads(plan))
    assert re.search(rf'"Index Name": "memories_p\d{{3}}_hnsw_{DIM}"', text), text  # the bucket's partition's


async def test_hnsw_search_with_a_selective_filter_is_complete_and_accurate(
    index_pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    _, large = corpora
    matching = sum(matches(RARE, m) for m in large.metadata)
    assert 0.02 * len(large.ids) < matching < 0.04 * len(large.ids)
    store = PostgresMemoryStore(index_pool)
    recalls = []
    for query in large.queries:
        hits = await search(store, large, query, k=K, f=RARE, exact=False)
        assert len(hits) == min(K, matching)
        assert all(hit.memory.metadata["rare"] is True for hit in hits)
        assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
        assert len({hit.memory.id for hit in hits}) == len(hits)
        recalls.append(recall(large, query, hits, K, RARE))
    assert np.mean(recalls) >= 0.9, recalls


async def test_hnsw_search_returns_every_match_when_fewer_than_k(
    index_pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    _, large = corpora
    few = Condition("n", Operator.IN, values=(0, 999, 2500, 4242))
    hits = await search(PostgresMemoryStore(index_pool), large, large.queries[1], k=K, f=few, exact=False)
    assert sorted(hit.memory.id for hit in hits) == sorted(large.ids[i] for i in (0, 999, 2500, 4242))


async def test_hnsw_search_without_a_filter_has_high_recall(
    index_pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    _, large = corpora
    store = PostgresMemoryStore(index_pool)
    recalls = []
    for query in large.queries:
        hits = await search(store, large, query, k=K, f=None, exact=False)
        assert len(hits) == K
        recalls.append(recall(large, query, hits, K, None))
    assert np.mean(recalls) >= 0.9, recalls


async def test_the_non_exact_path_with_the_planners_own_choice_is_complete(
    pool: asyncpg.Pool, corpora: tuple[Corpus, Corpus]
) -> None:
    """What the service runs: whichever plan PostgreSQL picks, a filtered search finds k rows."""
    _, large = corpora
    store = PostgresMemoryStore(pool)
    recalls = []
    for query in large.queries:
        hits = await search(store, large, query, k=K, f=RARE, exact=False)
        assert len(hits) == K
        assert all(hit.memory.metadata["rare"] is True for hit in hits)
        recalls.append(recall(large, query, hits, K, RARE))
    assert np.mean(recalls) >= 0.9, recalls
