"""PostgresMemoryStore against the contract in its module docstring, on the real database.

Every test works in fresh buckets (and, where a memory space is pinned, a fresh agent): the session
database is shared by every test module, so nothing here may assume an empty table.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import numpy as np
import pytest

from tests.storage.search_support import bucket_size, search_candidates, vector_search, vector_sql
from tests.support import SharedDatabase, service_settings
from tokensvc.auth.devpki import DevPaths
from tokensvc.embedders import EmbedderSpec
from tokensvc.errors import AlreadyExists
from tokensvc.memory.filters import Condition, Operator
from tokensvc.memory.models import MemorySpace, NewMemory
from tokensvc.retrieval import BM25_B, BM25_K1, or_query
from tokensvc.storage.postgres import Database
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import CandidateQuery, Tenant

DIM = 384
EMBEDDER = "test"


def text_query(text: str, *, exact: bool = True, vector: np.ndarray | None = None) -> CandidateQuery:
    """A TEXT (or, with a vector, HYBRID) candidate query with the service's constants."""
    return CandidateQuery(
        vector=vector,
        text=text,
        or_text=or_query(text),
        text_config="english",
        k=10,
        row_count=100,
        exact=exact,
        neighbours=vector is not None,
        bm25_k1=BM25_K1,
        bm25_b=BM25_B,
        ef_search=40,
        max_scan_tuples=20_000,
    )


def new_bucket() -> str:
    return "v1." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")


def unit(rng: np.random.Generator, dim: int = DIM) -> np.ndarray:
    vector = rng.standard_normal(dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


def memory(
    content: str,
    embedding: np.ndarray,
    *,
    metadata: dict[str, Any] | None = None,
    key: str | None = None,
    ttl: int | None = None,
) -> NewMemory:
    return NewMemory(
        id=str(uuid.uuid4()),
        content=content,
        content_sha256=hashlib.sha256(content.encode()).digest(),
        metadata=metadata or {},
        idempotency_key=key,
        ttl_seconds=ttl,
        embedding=embedding,
    )


def sha(content: str) -> bytes:
    return hashlib.sha256(content.encode()).digest()


@pytest.fixture(scope="module")
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    """A pool of the serving role, opened the way the service opens it."""
    db = await Database.locate(service_settings(database, dev, tmp_path_factory.mktemp("store")))
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


async def test_insert_stores_every_row_and_reports_each_as_inserted(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [
        memory("the sky is blue", unit(rng), metadata={"topic": "sky", "n": 1, "ok": True}, key="k1"),
        memory("grass is green", unit(rng)),
        memory("snow is white", unit(rng), ttl=3600),
    ]

    refs = await store.insert(tenant, bucket, rows)

    assert sorted((r.id, r.content_sha256, r.idempotency_key, r.inserted) for r in refs) == sorted(
        (r.id, r.content_sha256, r.idempotency_key, True) for r in rows
    )
    stored = await store.get(tenant, bucket, rows[0].id, EMBEDDER)
    assert stored is not None
    assert stored.content == "the sky is blue"
    assert stored.metadata == {"topic": "sky", "n": 1, "ok": True}
    assert stored.embedder == EMBEDDER
    assert stored.expires_at is None
    assert stored.created_at == stored.updated_at
    snow = await store.get(tenant, bucket, rows[2].id, EMBEDDER)
    assert snow is not None
    assert snow.expires_at is not None
    assert 3590 < (snow.expires_at - snow.created_at).total_seconds() <= 3600
    assert len(await all_rows(pool, [bucket])) == 3


async def test_insert_is_all_or_nothing(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    # The batch's dimension comes from its first row: a row of another dimension fails the CHECK.
    good = memory("a valid memory", unit(rng))
    bad = memory("a vector of the wrong dimension", unit(rng, 8))

    with pytest.raises(asyncpg.CheckViolationError):
        await store.insert(tenant, bucket, [good, bad])

    assert await all_rows(pool, [bucket]) == []


async def test_same_content_in_the_same_bucket_is_stored_once(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("remember the milk", unit(rng))
    await store.insert(tenant, bucket, [first])
    again = memory("remember the milk", unit(rng))  # a new id, the same content hash
    other = memory("buy bread", unit(rng))

    refs = await store.insert(tenant, bucket, [again, other])

    by_hash = {ref.content_sha256: ref for ref in refs}
    assert len(refs) == 2, "one ref per row: the fresh one inserted, the duplicate pointing at the original"
    assert by_hash[sha("remember the milk")].id == first.id
    assert by_hash[sha("remember the milk")].inserted is False
    assert by_hash[sha("buy bread")].id == other.id
    assert by_hash[sha("buy bread")].inserted is True
    assert sorted(row["id"] for row in await all_rows(pool, [bucket])) == sorted([first.id, other.id])


async def test_a_repeated_idempotency_key_returns_the_existing_row(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("pay the rent", unit(rng), key="req-1")
    await store.insert(tenant, bucket, [first])

    refs = await store.insert(tenant, bucket, [memory("pay the rent", unit(rng), key="req-1")])

    assert [(ref.id, ref.idempotency_key, ref.inserted) for ref in refs] == [(first.id, "req-1", False)]
    found = await store.find_existing(tenant, bucket, [], ["req-1"])
    assert [(ref.id, ref.inserted) for ref in found] == [(first.id, False)]
    assert len(await all_rows(pool, [bucket])) == 1


async def test_an_idempotency_key_reused_for_other_content_inserts_nothing(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("water the plants", unit(rng), key="req-2")
    await store.insert(tenant, bucket, [first])

    with pytest.raises(AlreadyExists):
        await store.insert(
            tenant,
            bucket,
            [memory("a fresh memory", unit(rng)), memory("feed the cat", unit(rng), key="req-2")],
        )

    assert [row["id"] for row in await all_rows(pool, [bucket])] == [first.id]


async def test_the_same_content_in_another_bucket_is_another_memory(
    store: PostgresMemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    other = Tenant(tenant.namespace, tenant.agent, (other_bucket,))
    mine = memory("shared words", unit(rng), key="same-key")
    theirs = memory("shared words", unit(rng), key="same-key")

    assert (await store.insert(tenant, bucket, [mine]))[0].inserted
    assert (await store.insert(other, other_bucket, [theirs]))[0].inserted

    assert [r.id for r in await store.find_existing(tenant, bucket, [sha("shared words")], [])] == [mine.id]
    assert [r.id for r in await store.find_existing(other, other_bucket, [], ["same-key"])] == [theirs.id]


# --- expiry -----------------------------------------------------------------------------------


async def test_expired_rows_are_never_returned_counted_or_updated(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    query = unit(rng)
    live = memory("still true", unit(rng), metadata={"kind": "fact"})
    # ttl 0: expires at the inserting transaction's now(), so it is expired in every later one.
    expired = memory("no longer true", query, metadata={"kind": "fact"}, key="gone", ttl=0)
    await store.insert(tenant, bucket, [live, expired])
    assert len(await all_rows(pool, [bucket])) == 2, "the expired row is still in the table"
    search = {"filter_": None, "ef_search": 40, "max_scan_tuples": 20_000, "embedder": EMBEDDER}

    assert await store.get(tenant, bucket, expired.id, EMBEDDER) is None
    for exact in (True, False):
        hits = await vector_search(store, tenant, bucket, query, k=10, exact=exact, **search)
        assert [hit.memory.id for hit in hits] == [live.id]
    for exact in (True, False):
        found = await search_candidates(
            store, tenant, bucket, text_query("true", exact=exact), filter_=None, embedder=EMBEDDER
        )
        assert [c.item.id for c in found] == [live.id]
    page = await store.list_page(
        tenant,
        bucket,
        limit=10,
        after=None,
        filter_=Condition("kind", Operator.EQ, "fact"),
        embedder=EMBEDDER,
    )
    assert [record.id for record in page] == [live.id]
    assert await store.find_existing(tenant, bucket, [expired.content_sha256], ["gone"]) == []
    assert (
        await store.update(
            tenant,
            bucket,
            expired.id,
            content=None,
            metadata={"kind": "revived"},
            ttl_seconds=3600,
            embedder=EMBEDDER,
        )
        is None
    )
    assert await store.delete(tenant, bucket, [expired.id]) == 0

    # Re-remembering expired content stores it afresh (the expired row does not block it).
    again = memory("no longer true", unit(rng), key="gone")
    refs = await store.insert(tenant, bucket, [again])
    assert [(ref.id, ref.inserted) for ref in refs] == [(again.id, True)]
    assert sorted(row["id"] for row in await all_rows(pool, [bucket])) == sorted([live.id, again.id])

    await store.insert(tenant, bucket, [memory("soon gone", unit(rng), ttl=0)])
    assert await store.delete_all(tenant, bucket) == 2, "the expired row is deleted but not counted"
    assert await all_rows(pool, [bucket]) == []


# --- reads ------------------------------------------------------------------------------------


async def test_list_page_is_newest_first_and_resumes_strictly_after_the_cursor(
    store: PostgresMemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    ids: list[str] = []
    for batch in range(3):  # separate inserts, plus rows within one statement (ties broken by id)
        rows = [
            memory(f"note {batch}-{i}", unit(rng), metadata={"even": (batch * 3 + i) % 2 == 0})
            for i in range(3)
        ]
        await store.insert(tenant, bucket, rows)
        ids += [row.id for row in rows]
    everything = await store.list_page(tenant, bucket, limit=100, after=None, filter_=None, embedder=EMBEDDER)
    keys = [(record.created_at, record.id) for record in everything]
    assert sorted(record.id for record in everything) == sorted(ids)
    assert keys == sorted(keys, reverse=True)
    assert everything[-1].id == ids[0], "the first memory is the oldest"

    for filter_, expected in (
        (None, [record.id for record in everything]),
        (
            Condition("even", Operator.EQ, True),
            [record.id for record in everything if record.metadata["even"]],
        ),
    ):
        seen: list[str] = []
        after = None
        while True:
            page = await store.list_page(
                tenant, bucket, limit=2, after=after, filter_=filter_, embedder=EMBEDDER
            )
            seen += [record.id for record in page]
            if len(page) < 2:
                break
            after = (page[-1].created_at, page[-1].id)
        assert seen == expected


async def test_reads_and_writes_never_reach_another_bucket(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    other = Tenant(tenant.namespace, tenant.agent, (other_bucket,))
    theirs = [memory(f"their memory {i}", unit(rng), metadata={"i": i}) for i in range(3)]
    await store.insert(other, other_bucket, theirs)
    mine = memory("my memory", unit(rng))
    await store.insert(tenant, bucket, [mine])
    their_ids = [row.id for row in theirs]

    # The right tenant with the wrong bucket argument, and the other tenant's ids in my bucket.
    assert await store.get(tenant, bucket, their_ids[0], EMBEDDER) is None
    assert await store.delete(tenant, bucket, [*their_ids, mine.id, str(uuid.uuid4())]) == 1
    assert await store.delete(other, other_bucket, [mine.id]) == 0
    assert await store.find_existing(tenant, bucket, [theirs[0].content_sha256], []) == []
    assert (
        await store.update(
            tenant,
            bucket,
            their_ids[1],
            content=None,
            metadata={"i": 99},
            ttl_seconds=None,
            embedder=EMBEDDER,
        )
        is None
    )
    assert await store.list_page(tenant, bucket, limit=10, after=None, filter_=None, embedder=EMBEDDER) == []
    assert await bucket_size(store, tenant, bucket, 100) == 0
    assert await store.delete_all(tenant, bucket) == 0

    after = await all_rows(pool, [other_bucket])
    assert sorted(row["id"] for row in after) == sorted(their_ids)
    record = await store.get(other, other_bucket, their_ids[1], EMBEDDER)
    assert record is not None
    assert record.metadata == {"i": 1}


async def test_update_changes_content_metadata_and_expiry(
    store: PostgresMemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("the meeting is on monday", unit(rng), metadata={"a": 1})
    neighbour = memory("the office is in paris", unit(rng))
    await store.insert(tenant, bucket, [row, neighbour])
    new_vector = unit(rng)

    updated = await store.update(
        tenant,
        bucket,
        row.id,
        content=("the meeting is on tuesday", sha("the meeting is on tuesday"), new_vector),
        metadata={"b": "two"},
        ttl_seconds=600,
        embedder=EMBEDDER,
    )

    assert updated is not None
    assert (updated.id, updated.content, updated.metadata) == (
        row.id,
        "the meeting is on tuesday",
        {"b": "two"},
    )
    assert updated.updated_at > updated.created_at
    assert updated.expires_at is not None
    hits = await vector_search(
        store,
        tenant,
        bucket,
        new_vector,
        k=1,
        filter_=None,
        exact=True,
        ef_search=40,
        max_scan_tuples=1000,
        embedder=EMBEDDER,
    )
    assert [(hit.memory.id, round(hit.score, 5)) for hit in hits] == [(row.id, 1.0)]
    found = await store.find_existing(tenant, bucket, [sha("the meeting is on tuesday")], [])
    assert [ref.id for ref in found] == [row.id]

    with pytest.raises(AlreadyExists) as raised:
        await store.update(
            tenant,
            bucket,
            row.id,
            content=("the office is in paris", sha("the office is in paris"), unit(rng)),
            metadata=None,
            ttl_seconds=None,
            embedder=EMBEDDER,
        )
    assert raised.value.field == "content"
    unchanged = await store.get(tenant, bucket, row.id, EMBEDDER)
    assert unchanged is not None
    assert unchanged.content == "the meeting is on tuesday"


# --- deletes ----------------------------------------------------------------------------------


async def test_delete_all_empties_the_bucket_and_touches_nothing_else(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    await store.insert(tenant, bucket, [memory(f"mine {i}", unit(rng)) for i in range(4)])
    await store.insert(tenant, bucket, [memory("mine, expired", unit(rng), ttl=0)])
    theirs = [memory(f"mine {i}", unit(rng)) for i in range(2)]  # same contents, another bucket
    await store.insert(Tenant(tenant.namespace, tenant.agent, (other_bucket,)), other_bucket, theirs)

    assert await store.delete_all(tenant, bucket) == 4

    assert await all_rows(pool, [bucket]) == []
    assert sorted(row["id"] for row in await all_rows(pool, [other_bucket])) == sorted(r.id for r in theirs)
    assert await store.delete_all(tenant, bucket) == 0


async def test_delete_removes_the_listed_rows_and_counts_them(
    store: PostgresMemoryStore, pool: asyncpg.Pool, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(f"row {i}", unit(rng)) for i in range(5)]
    await store.insert(tenant, bucket, rows)

    assert await store.delete(tenant, bucket, [rows[0].id, rows[3].id, rows[3].id, str(uuid.uuid4())]) == 2
    assert await store.delete(tenant, bucket, [rows[0].id]) == 0

    remaining = sorted(row["id"] for row in await all_rows(pool, [bucket]))
    assert remaining == sorted(row.id for row in (rows[1], rows[2], rows[4]))


# --- pepper rotation --------------------------------------------------------------------------


async def test_move_buckets_moves_rows_into_the_current_bucket_and_drops_duplicates(
    store: PostgresMemoryStore, pool: asyncpg.Pool, rng: np.random.Generator
) -> None:
    target, older, oldest = new_bucket(), new_bucket(), new_bucket()
    tenant = Tenant("store-tests", "rotating", (target, older, oldest))
    kept = memory("in the target already", unit(rng), key="k-target")
    await store.insert(tenant, target, [kept, memory("expired in the target", unit(rng), ttl=0)])
    moved_older = [
        memory("only in older", unit(rng), key="k-older"),
        memory("in both older buckets", unit(rng)),
        memory("expired in the target", unit(rng)),  # live here: must survive the move
    ]
    await store.insert(
        tenant,
        older,
        [
            *moved_older,
            memory("in the target already", unit(rng)),  # same content as a target row
            memory("other content, the target's key", unit(rng), key="k-target"),
        ],
    )
    only_oldest = memory("only in oldest", unit(rng))
    await store.insert(
        tenant,
        oldest,
        [
            only_oldest,
            memory("in both older buckets", unit(rng)),  # duplicate of a row moved from `older`
            memory("expired in oldest", unit(rng), ttl=0),
        ],
    )

    assert await store.move_buckets(tenant, target, [older, oldest]) == 4

    rows = await all_rows(pool, [target, older, oldest])
    assert {row["bucket"] for row in rows} == {target}
    assert sorted(row["id"] for row in rows) == sorted(
        [kept.id, only_oldest.id, *(row.id for row in moved_older)]
    )
    assert all(row["expires_at"] is None for row in rows)
    current = Tenant("store-tests", "rotating", (target,))
    found = await store.find_existing(current, target, [sha("only in older")], ["k-target"])
    assert sorted(ref.id for ref in found) == sorted([moved_older[0].id, kept.id])
    assert await store.move_buckets(tenant, target, [older, oldest]) == 0


# --- sizes, spaces and indexes ----------------------------------------------------------------


async def test_bucket_size_counts_up_to_the_cap(
    store: PostgresMemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    assert await bucket_size(store, tenant, bucket, 10) == 0
    await store.insert(tenant, bucket, [memory(f"m{i}", unit(rng)) for i in range(5)])

    assert await bucket_size(store, tenant, bucket, 3) == 3
    assert await bucket_size(store, tenant, bucket, 5) == 5
    assert await bucket_size(store, tenant, bucket, 1000) == 5


async def test_a_space_is_pinned_once_and_visible_only_to_its_agent(
    store: PostgresMemoryStore, tenant: Tenant
) -> None:
    spec = MemorySpace(EmbedderSpec("hash", "hash-v1", DIM, True), "english")
    assert await store.get_space(tenant) is None

    assert await store.pin_space(tenant, spec) == spec
    assert (
        await store.pin_space(tenant, MemorySpace(EmbedderSpec("openai", "other-model", 256, True), "simple"))
        == spec
    )

    assert await store.get_space(tenant) == spec
    assert await store.get_space(Tenant(tenant.namespace, f"{tenant.agent}-other")) is None
    assert await store.get_space(Tenant(f"{tenant.namespace}-other", tenant.agent)) is None


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
        assert f'"Index Name": "memories_hnsw_{dim}"' in plan
        assert "memories_hnsw_" + str(256 if dim == DIM else DIM) not in plan
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


async def test_ensure_vector_index_is_idempotent(store: PostgresMemoryStore, pool: asyncpg.Pool) -> None:
    await store.ensure_vector_index(256)
    await store.ensure_vector_index(256)
    async with pool.acquire() as conn:
        count = await conn.fetchval(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'tokensvc' AND indexname = 'memories_hnsw_256'"
        )
    assert count == 1
