"""Row-level security on the knowledge tables: queries that forget their predicate still see only
the namespace and the knowledge bases their transaction declared."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import numpy as np
import pytest

from tests.storage.test_memory_rls import open_pool
from tests.support import SharedDatabase
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.ingestion_records import Extracted, StagedChunk
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, BaseRow, ChunkRow, Tenant

TABLES = ("knowledge_bases", "documents", "chunks", "ingestions", "ingestion_content", "ingestion_chunks")
# One corpus's rows in each (`corpus`).
CORPUS = {
    "knowledge_bases": 1,
    "documents": 1,
    "chunks": 2,
    "ingestions": 1,
    "ingestion_content": 1,
    "ingestion_chunks": 2,
}


@pytest.fixture(scope="module")
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    db, pool = await open_pool(database, dev, tmp_path_factory)
    try:
        yield pool
    finally:
        await db.close()


@pytest.fixture(autouse=True)
async def corpora_deleted(pool: asyncpg.Pool) -> AsyncIterator[None]:
    """The test's corpora are deleted after it: their queued versions leave the shared queue."""
    yield
    store = PostgresKnowledgeStore(pool)
    while CORPORA:
        namespace, ref = CORPORA.pop()
        await store.delete_base(Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,)), ref)


CORPORA: list[tuple[str, str]] = []


async def corpus(pool: asyncpg.Pool, namespace: str, ref: str) -> None:
    """One knowledge base with one document of two chunks, and its next version on its way in
    with two chunks staged."""
    CORPORA.append((namespace, ref))
    store = PostgresKnowledgeStore(pool)
    base = BaseRow(namespace, ref, "", "hash", "hash-v1", 384, True, "fixed", 64, 0, "english", None)  # type: ignore[arg-type]
    await store.create_base(Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,)), base)
    vector = np.ones(384, dtype=np.float32) / np.sqrt(384)
    chunks = [ChunkRow(i, f"text {i}", 0, 6, (), vector) for i in range(2)]
    await store.replace_document(
        Tenant(namespace, knowledge_bases=(ref,)),
        kb_ref=ref,
        ref="doc",
        content_type="text/plain",
        content_sha256=bytes(32),
        size_bytes=12,
        metadata={},
        chunks=chunks,
    )
    ingestion = PostgresIngestionStore(pool)
    enqueued = await ingestion.enqueue(
        Tenant(namespace, knowledge_bases=(ref,)),
        kb_ref=ref,
        ref="doc",
        content_type="text/plain",
        content_sha256=bytes(31) + b"\x01",
        size_bytes=12,
        metadata={},
        content=b"next version",
    )
    assert enqueued is not None
    assert enqueued.ingestion is not None
    job = await ingestion.claim_one(enqueued.ingestion, "rls", lease_seconds=60)
    assert job is not None
    staged = [StagedChunk(i, f"next {i}", 0, 6, ()) for i in range(2)]
    assert await ingestion.store_extraction(
        job, "rls", Extracted("next version", (), "text/plain", staged, 0)
    )


async def counts(pool: asyncpg.Pool, tenant: Tenant | None) -> dict[str, int]:
    """Rows per table seen by a query with NO predicate at all."""
    found: dict[str, int] = {}
    if tenant is None:
        async with pool.acquire() as conn:
            for table in TABLES:
                found[table] = await conn.fetchval(f"SELECT count(*) FROM {table}")  # noqa: S608
        return found
    async with tenant_transaction(pool, tenant) as conn:
        for table in TABLES:
            found[table] = await conn.fetchval(f"SELECT count(*) FROM {table}")  # noqa: S608
    return found


async def test_unpredicated_queries_see_only_the_declared_namespace_and_knowledge_bases(
    pool: asyncpg.Pool,
) -> None:
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ours, "kb1")
    await corpus(pool, ours, "kb2")
    await corpus(pool, theirs, "kb1")

    assert await counts(pool, Tenant(ours, knowledge_bases=("kb1",))) == CORPUS
    assert await counts(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) == {
        table: 2 * n for table, n in CORPUS.items()
    }
    assert await counts(pool, Tenant(ours)) == dict.fromkeys(TABLES, 0)
    assert await counts(pool, None) == dict.fromkeys(TABLES, 0)


async def test_writes_outside_the_declared_namespace_are_refused(pool: asyncpg.Pool) -> None:
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, theirs, "kb1")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with tenant_transaction(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
            await conn.execute(
                "INSERT INTO knowledge_bases (namespace, ref, embedder, model, dimension, normalized, chunking, "
                "chunk_size, chunk_overlap) VALUES ($1, 'kb1', 'hash', 'hash-v1', 384, true, 'fixed', 64, 0)",
                theirs,
            )
    async with tenant_transaction(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
        assert await conn.execute("DELETE FROM chunks WHERE namespace = $1", theirs) == "DELETE 0"
        assert await conn.execute("DELETE FROM documents WHERE namespace = $1", theirs) == "DELETE 0"
        for table in ("ingestion_chunks", "ingestion_content", "ingestions"):
            assert await conn.execute(f"DELETE FROM {table} WHERE namespace = $1", theirs) == "DELETE 0"  # noqa: S608
    assert await counts(pool, Tenant(theirs, knowledge_bases=("kb1",))) == CORPUS
