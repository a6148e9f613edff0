"""PostgresMemoryStore beyond the port's contract, on the real database: what only PostgreSQL
has (the dimension CHECK, expired rows physically left until a write or the sweep removes them,
per-dimension HNSW indexes and the plans that use them).

The contract itself (dedupe, keys, paging, expiry, isolation, ranking, counting...) is checked for
every implementation by `tests/storage/conformance/`. Every test here works in fresh buckets (and,
where a memory space is pinned, a fresh agent): the session database is shared by every module.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import numpy as np
import pytest

from tests.storage.search_support import EmbeddedLater, vector_search, vector_sql
from tests.support import SharedDatabase, service_settings
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.retrieval.planning import candidate_query
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.postgres.memories import PostgresMemoryStore, search_statement
from tokensvc.storage.postgres.ranking import WHOLE_READ_ROWS
from tokensvc.storage.postgres.tenant import distributed_pool, tenant_transaction
from tokensvc.storage.records import Candidate, EmbedderSpec, MemoryRecord, MemorySpace, NewMemory, Tenant

DIM = 384
EMBEDDER = "test"


def new_bucket() -> str:
    return "v1." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")


def unit(rng: np.random.Generator, dim: int = DIM) -> np.ndarray:
    vector = rng.standard_normal(dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


def memory(
    content: str, embedding: np.ndarray, *, metadata: dict[str, Any] | None = None, ttl: int | None = None
) -> NewMemory:
    return NewMemory(
        id=str(uuid.uuid4()),
        content=content,
        content_sha256=hashlib.sha256(content.encode()).digest(),
        metadata=metadata or {},
        idempotency_key=None,
        ttl_seconds=ttl,
        embedding=embedding,
    )


@pytest.fixture(scope="module")
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    """A pool of the serving role, opened the way the service opens it."""
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("store")))
    try:
        yield await db.open_pool()
    finally:
        await db.close()


@pytest.fixture
def store(pool: asyncpg.Pool) -> PostgresMemoryStore:
    return PostgresMemoryStore(pool)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240604)


@pytest.fixture
def bucket() -> str:
    return new_bucket()


@pytest.fixture
def tenant(bucket: str) -> Tenant:
    return Tenant("store-tests", f"agent-{uuid.uuid4().hex[:12]}", (bucket,))


async def all_rows(pool: asyncpg.Pool, buckets: Sequence[str]) -> list[asyncpg.Record]:
    """Every row of `buckets`, expired or not (no liveness predicate), oldest first."""
    async with tenant_transaction(pool, Tenant("store-tests", "inspector", tuple(buckets))) as conn:
        return await conn.fetch(
            "SELECT bucket, id::text AS id, content, content_sha256, idempotency_key, expires_at "
            "FROM memories WHERE bucket = ANY($1::text[]) ORDER BY created_at, id",
            list(buckets),
        )


# --- insert -----------------------------------------------------------------------------------


async def test_insert_is_all_or_nothing(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    # The batch's dimension comes from its first row: a row of another dimension fails the CHECK.
    good = memory("a valid memory", unit(rng))
    bad = memory("a vector of the wrong dimension", unit(rng, 8))

    with pytest.raises(asyncpg.CheckViolationError):
        await store.insert(tenant, bucket, [good, bad])

    assert await all_rows(pool, [bucket]) == []


async def test_expired_rows_stay_in_the_table_until_a_write_or_the_sweep_removes_them(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    # ttl 0: expires at the inserting transaction's clock, so it is expired in every later one.
    await store.insert(
        tenant, bucket, [memory("no longer true", unit(rng), ttl=0), memory("true", unit(rng))]
    )
    assert len(await all_rows(pool, [bucket])) == 2, "the expired row is still in the table"

    # Re-remembering the expired content deletes the dead row in the same transaction.
    again = memory("no longer true", unit(rng))
    await store.insert(tenant, bucket, [again])
    assert sorted(row["content"] for row in await all_rows(pool, [bucket])) == ["no longer true", "true"]

    await store.insert(tenant, bucket, [memory("soon gone", unit(rng), ttl=0)])
    while await store.sweep_expired() > 0:
        pass
    assert sorted(row["content"] for row in await all_rows(pool, [bucket])) == ["no longer true", "true"]
    await store.insert(tenant, bucket, [memory("gone again", unit(rng), ttl=0)])
    assert await store.delete_all(tenant, bucket) == 2, "the expired row is deleted but not counted"
    assert await all_rows(pool, [bucket]) == []


# --- spaces and indexes -------------------------------------------------------------------------


async def hnsw_plan(pool: asyncpg.Pool, tenant: Tenant, bucket: str, query: np.ndarray) -> str:
    """EXPLAIN of exactly the SQL `search_vector(exact=False)` runs, with its scan settings.

    The planner picks between the HNSW index and "the bucket's rows, sorted" by cost, and small
    buckets rightly go the second way; `enable_sort = off` asks whether the index *can* serve this
    SQL (expression and partial-index predicate match), which is what the store controls.
    """
    # The production statement and its settings (enable_sort = off among them).
    sql, params, settings = vector_sql(
        bucket, query, k=10, filter_=Condition("n", Operator.GTE, 0), exact=False
    )
    async with tenant_transaction(pool, tenant, settings=settings) as conn:
        plan = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params)
    return json.dumps(plan if isinstance(plan, list) else json.loads(plan))


async def test_spaces_of_different_dimensions_both_store_search_and_use_their_own_index(
    store: PostgresMemoryStore, pool: asyncpg.Pool, rng: np.random.Generator
) -> None:
    for dim in (DIM, 256):
        bucket = new_bucket()
        tenant = Tenant("store-tests", f"dims-{dim}-{uuid.uuid4().hex[:8]}", (bucket,))
        spec = MemorySpace(EmbedderSpec("test", f"model-{dim}", dim, True), "english")
        assert await store.pin_space(tenant, spec) == spec  # creates memories_hnsw_<dim> if missing
        rows = [memory(f"{dim}-d memory {i}", unit(rng, dim), metadata={"n": i}) for i in range(50)]
        await store.insert(tenant, bucket, rows)
        target = rows[17]

        for exact in (True, False):
            hits = await vector_search(
                store,
                tenant,
                bucket,
                target.embedding,
                k=3,
                filter_=None,
                exact=exact,
                ef_search=40,
                max_scan_tuples=20_000,
                embedder=EMBEDDER,
            )
            assert len(hits) == 3
            assert hits[0].memory.id == target.id
            assert hits[0].score == pytest.approx(1.0, abs=1e-5)

        plan = await hnsw_plan(pool, tenant, bucket, target.embedding)
        # One partition's index of this dimension (memories_pNNN_hnsw_D), none of the other.
        assert re.search(rf'"Index Name": "memories_p\d{{3}}_hnsw_{dim}"', plan), plan
        assert "_hnsw_" + str(256 if dim == DIM else DIM) not in plan
        exact_sql, params, _ = vector_sql(bucket, target.embedding, k=3, filter_=None, exact=True)
        async with tenant_transaction(pool, tenant) as conn:
            exact_plan = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN {exact_sql}", *params))
        assert "hnsw" not in exact_plan, "the exact path scans the bucket's rows"

    async with pool.acquire() as conn:
        indexes = await conn.fetch(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'tokensvc' AND tablename = 'memories' "
            "AND indexname LIKE 'memories_hnsw_%'"
        )
    assert {f"memories_hnsw_{DIM}", "memories_hnsw_256"} <= {row[0] for row in indexes}


async def test_an_approximate_hybrid_search_loops_only_over_rows_it_looks_up_by_key(
    store: PostgresMemoryStore, pool: asyncpg.Pool, rng: np.random.Generator
) -> None:
    """The planner cannot see the sizes of the statement's own parts (BM25 scores of up to 10,000
    matching rows): a nested loop over one rescans it per candidate. Every nested loop of the
    approximate HYBRID statement must be a lookup by key into the table, none a rescan of a CTE."""
    bucket = new_bucket()
    tenant = Tenant("store-tests", f"loops-{uuid.uuid4().hex[:8]}", (bucket,))
    assert await store.pin_space(tenant, MemorySpace(EmbedderSpec("test", "loops", DIM, True), "simple"))
    await store.insert(tenant, bucket, [memory(f"apple pie number {i}", unit(rng)) for i in range(30)])
    query = candidate_query(
        vector=unit(rng), text="apple pie", k=10, rows=30, exact=False, neighbours=True, text_config="simple"
    )
    sql, params, settings = search_statement(bucket, query, None)
    async with tenant_transaction(pool, tenant, settings=settings) as conn:
        plan = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params)
    plan = plan if isinstance(plan, list) else json.loads(plan)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    def once(node: dict[str, Any]) -> bool:  # one row: BM25's stats, an aggregate without groups
        plain = node["Node Type"] == "Aggregate" and node.get("Strategy") == "Plain"
        return plain or (node["Node Type"] == "CTE Scan" and node.get("CTE Name") == "stats")

    loops = [n for n in nodes(plan[0]["Plan"]) if n["Node Type"] == "Nested Loop" and not once(n["Plans"][0])]
    assert loops, "no key lookups at all: the statement's shape changed, update this test"
    for loop in loops:
        inner = loop["Plans"][1]
        scanned = {n["Node Type"] for n in nodes(inner)}
        assert "CTE Scan" not in scanned, json.dumps(loop, indent=1)


async def test_ensure_vector_index_is_idempotent(store: PostgresMemoryStore, pool: asyncpg.Pool) -> None:
    await store.ensure_vector_index(256)
    await store.ensure_vector_index(256)
    async with pool.acquire() as conn:
        count = await conn.fetchval(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'tokensvc' AND indexname = 'memories_hnsw_256'"
        )
    assert count == 1


async def search_ahead(
    store: PostgresMemoryStore,
    pool: asyncpg.Pool,
    tenant: Tenant,
    text: str,
    *,
    exact: bool,
    rows: int,
    vector: np.ndarray,
) -> tuple[int, list[Candidate[MemoryRecord]]]:
    """A HYBRID search (top 5, neighbours) told the bucket has `rows` rows, its vector given only
    once the store waits for it: the connections in use at that moment, and the candidates."""
    later = EmbeddedLater()
    query = candidate_query(
        vector=None, text=text, k=5, rows=rows, exact=exact, neighbours=True, text_config="simple",
        vector_later=later,
    )  # fmt: skip
    bucket = tenant.buckets[0]
    searching = asyncio.ensure_future(
        store.search(
            tenant, bucket, lambda _rows: query, row_count=rows, count_cap=1, filter_=None, embedder="test"
        )
    )
    await asyncio.wait_for(later.awaited.wait(), 30)
    in_use = pool.get_size() - pool.get_idle_size()
    later.vector.set_result(vector)
    return in_use, (await searching).candidates


@pytest.mark.parametrize(("exact", "held"), [(True, False), (False, True)])
async def test_a_hybrid_search_waits_for_its_vector_holding_a_connection_only_when_not_read_whole(
    store: PostgresMemoryStore, pool: asyncpg.Pool, rng: np.random.Generator, exact: bool, held: bool
) -> None:
    """A small exact search reads its rows whole and ends its transaction before it waits for its
    query's vector (ranked in Python after); an approximate one ranks by text, then waits in its
    transaction (one snapshot) and runs the candidate statement."""
    bucket = new_bucket()
    tenant = Tenant("store-tests", f"ahead-{uuid.uuid4().hex[:8]}", (bucket,))
    assert await store.pin_space(tenant, MemorySpace(EmbedderSpec("test", "ahead", DIM, True), "simple"))
    await store.insert(tenant, bucket, [memory(f"apple pie number {i}", unit(rng)) for i in range(12)])
    in_use, found = await search_ahead(
        store, pool, tenant, "apple pie", exact=exact, rows=12, vector=unit(rng)
    )

    assert not distributed_pool(pool)  # one node: the search ranks ahead (tests/citus: it does not)
    assert in_use == (1 if held else 0)
    assert len([c for c in found if c.vector_rank]) == 5
    assert all(c.text_rank or c.vector_rank for c in found)


async def test_a_search_told_too_small_a_count_reads_no_more_than_the_whole_read_limit(
    store: PostgresMemoryStore, pool: asyncpg.Pool, rng: np.random.Generator
) -> None:
    """A cached or capped count can say a bucket is small when it no longer is: the whole read
    stops one row past its limit and the search ranks by text instead, in its transaction."""
    bucket = new_bucket()
    tenant = Tenant("store-tests", f"stale-{uuid.uuid4().hex[:8]}", (bucket,))
    assert await store.pin_space(tenant, MemorySpace(EmbedderSpec("test", "stale", DIM, True), "simple"))
    size = WHOLE_READ_ROWS + 20
    vectors = rng.standard_normal((size, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for start in range(0, size, 500):
        await store.insert(
            tenant,
            bucket,
            [memory(f"pear note {i}", vectors[i]) for i in range(start, min(size, start + 500))],
        )
    in_use, found = await search_ahead(store, pool, tenant, "pear", exact=True, rows=10, vector=vectors[7])

    assert in_use == 1, "ranked by text and waiting in its transaction, not read whole"
    by_vector = sorted((c for c in found if c.vector_rank), key=lambda c: c.vector_rank)
    assert len(by_vector) == 5
    assert by_vector[0].item.content == "pear note 7"
