"""A knowledge base's migration against uploads in flight, in PostgreSQL (migration 0015's locks,
raced for real on separate connections).

An upload locks the base row FOR SHARE and the document row FOR UPDATE in its first statement,
so a runner's write of the same document either waits for it or is visible to its later
statements; the cutover and a cancel lock the base row before the migration's, and uploads never
lock the migration row, so no cycle of waits forms; a chunk for a generation that is gone is
refused by the database (a replica that never learnt of the cutover).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime

import asyncpg
import numpy as np
import pytest
from asyncpg.pool import PoolConnectionProxy
from pgvector import Vector

from tests.storage.migration_support import connect
from tests.storage.test_reembedding_races import begin, waiting_for_a_lock
from tests.support import SharedDatabase
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.records import BaseRow, ChunkingSpec, ChunkRow, EmbedderSpec, Tenant
from tokensvc.storage.reembedding_records import KnowledgeBaseMigration, MigrationState

TARGET = EmbedderSpec("target", "target-model", 4, True)
CHUNKING = ChunkingSpec("fixed", 64, 0)


@pytest.fixture
async def watcher(database: SharedDatabase) -> AsyncIterator[asyncpg.Connection]:
    conn = await connect(database, "superuser", database.dsn.rsplit("/", 1)[1])
    try:
        yield conn
    finally:
        await conn.close()


def rows(texts: list[str], dim: int) -> list[ChunkRow]:
    return [
        ChunkRow(i, t, 0, len(t), (), np.eye(dim, dtype=np.float32)[i % dim]) for i, t in enumerate(texts)
    ]


async def upload(
    store: PostgresKnowledgeStore,
    ns: str,
    doc: str,
    text: str,
    *,
    metadata: dict[str, str] | None = None,
    generation: int = 0,
    next_chunks: list[ChunkRow] | None = None,
    migration_id: str | None = None,
) -> None:
    await store.replace_document(
        Tenant(ns, knowledge_bases=("*",)),
        kb_ref="kb",
        ref=doc,
        content_type="text/plain",
        content_sha256=hashlib.sha256(text.encode()).digest(),
        size_bytes=len(text),
        metadata=metadata or {},
        chunks=rows([text], 8),
        generation=generation,
        text=text,
        next_chunks=next_chunks,
        migration_id=migration_id,
    )


async def migrating_base(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool
) -> tuple[str, KnowledgeBaseMigration, PostgresKnowledgeStore]:
    """A base of one document whose migration the runner "racer" has claimed."""
    store = PostgresKnowledgeStore(pool)
    migrations = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    ns = f"race-{uuid.uuid4().hex[:8]}"
    base = BaseRow(ns, "kb", "", "hash", "hash-v1", 8, True, "fixed", 64, 0, "simple", datetime.now(UTC))
    await store.create_base(Tenant(ns, knowledge_bases=("*",)), base)
    await upload(store, ns, "doc", "version one")
    created = await migrations.create(
        KnowledgeBaseMigration(
            id=str(uuid.uuid4()),
            namespace=ns,
            kb_ref="kb",
            from_generation=0,
            source=EmbedderSpec("hash", "hash-v1", 8, True),
            target=TARGET,
            source_chunking=CHUNKING,
            target_chunking=CHUNKING,
            state=MigrationState.BACKFILLING,
            created_by="test",
        )
    )
    assert created is not None
    for _ in range(200):  # other tests' migrations share the database: finish them
        claimed = await migrations.claim(
            "racer", lease_seconds=60, embedders=["target"], retire_after_seconds=0
        )
        assert claimed is not None
        if claimed.id == created.id:
            return ns, claimed, store
        await migrations.transition(claimed.id, expect=[claimed.state], state=MigrationState.CANCELLED)
    raise AssertionError("never claimed")


async def runner_writes_open(
    runner_pool: asyncpg.Pool, conn: asyncpg.Connection, migration: KnowledgeBaseMigration
) -> None:
    """The runner's batch for `doc` on `conn` (a connection of the runner's pool, as
    store_documents runs it), its transaction open."""
    (pending,) = await PostgresEmbeddingMigrationStore(runner_pool).pending_documents(migration, limit=10)
    await begin(conn, base_settings(migration.namespace))
    assert await conn.fetchval("SELECT hold_migration($1, 'racer')", migration.id)
    written = await conn.fetchval(
        "SELECT kb_migration_store($1, 'racer', ARRAY[$2], ARRAY[$3::bigint], ARRAY[$4::bytea], ARRAY[1], "
        "ARRAY[0], ARRAY['version one'], ARRAY[0], ARRAY[11], ARRAY['[]'], ARRAY[$5::vector])",
        migration.id,
        pending.ref,
        pending.version,
        pending.content_sha256,
        Vector(np.eye(4, dtype=np.float32)[0]),
    )
    assert written == 1


def base_settings(ns: str, kb: str = "kb") -> dict[str, str]:
    """The settings a runner's transaction declares for the base it migrates (`*`: every base)."""
    return {"tokensvc.namespace": ns, "tokensvc.kbs": kb}


async def generations(pool: asyncpg.Pool, ns: str) -> list[tuple[int, int, str, str]]:
    async with pool.acquire() as conn:
        await begin(conn, base_settings(ns))
        found = await conn.fetch(
            "SELECT generation, version, text, metadata::text FROM chunks WHERE namespace = $1 ORDER BY 1, 2",
            ns,
        )
        await conn.execute("COMMIT")
    return [(r[0], r[1], r[2], json.loads(r[3]).get("tag", "")) for r in found]


async def test_an_upload_waits_for_the_runners_write_and_then_removes_its_old_version(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, watcher: asyncpg.Connection
) -> None:
    ns, migration, store = await migrating_base(pool, runner_pool)
    runner = await runner_pool.acquire()
    try:
        await runner_writes_open(runner_pool, runner, migration)
        uploading = asyncio.create_task(upload(store, ns, "doc", "version two"))
        assert await waiting_for_a_lock(watcher, await _upload_pid(watcher)), "the upload did not wait"
        await runner.execute("COMMIT")
        await uploading
    finally:
        await runner_pool.release(runner)
    # The runner's chunks were of version one: gone with it, and version two is pending.
    assert await generations(pool, ns) == [(0, 2, "version two", "")]
    pending = await PostgresEmbeddingMigrationStore(runner_pool).pending_documents(
        replace(migration, document_cursor=None), limit=10
    )
    assert [(p.ref, p.version) for p in pending] == [("doc", 2)]


async def test_a_metadata_change_waits_for_the_runners_write_and_reaches_its_chunks(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, watcher: asyncpg.Connection
) -> None:
    ns, migration, store = await migrating_base(pool, runner_pool)
    runner = await runner_pool.acquire()
    try:
        await runner_writes_open(runner_pool, runner, migration)
        retagging = asyncio.create_task(upload(store, ns, "doc", "version one", metadata={"tag": "new"}))
        assert await waiting_for_a_lock(watcher, await _upload_pid(watcher)), "the upload did not wait"
        await runner.execute("COMMIT")
        await retagging
    finally:
        await runner_pool.release(runner)
    assert await generations(pool, ns) == [(0, 1, "version one", "new"), (1, 1, "version one", "new")]


async def test_a_batch_in_flight_and_a_cutover_never_deadlock(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, watcher: asyncpg.Connection
) -> None:
    """A batch holds the base row FOR SHARE when the cutover arrives, then locks the migration
    row: were the cutover to take the migration row first (0014's order), each would wait for the
    other and PostgreSQL would abort one."""
    ns, migration, store = await migrating_base(pool, runner_pool)
    batch = await runner_pool.acquire()
    cutting = await runner_pool.acquire()
    try:
        (pending,) = await PostgresEmbeddingMigrationStore(runner_pool).pending_documents(migration, limit=10)
        await begin(batch, base_settings(ns))
        await batch.execute("SELECT lock_migration_subject($1, false)", migration.id)
        await begin(cutting, base_settings(ns))
        cut = asyncio.create_task(
            cutting.fetchval("SELECT cut_over_knowledge_base($1, 'racer')", migration.id)
        )
        assert await waiting_for_a_lock(watcher, cutting.get_server_pid()), "the cutover did not wait"
        assert await batch.fetchval("SELECT hold_migration($1, 'racer')", migration.id), (
            "the batch could not take the migration row"
        )
        written = await batch.fetchval(
            "SELECT kb_migration_store($1, 'racer', ARRAY[$2], ARRAY[$3::bigint], ARRAY[$4::bytea], ARRAY[1], "
            "ARRAY[0], ARRAY['version one'], ARRAY[0], ARRAY[11], ARRAY['[]'], ARRAY[$5::vector])",
            migration.id,
            pending.ref,
            pending.version,
            pending.content_sha256,
            Vector(np.eye(4, dtype=np.float32)[0]),
        )
        assert written == 1
        await batch.execute("COMMIT")
        assert await cut is True  # after the batch: every document has its chunks
        await cutting.execute("COMMIT")
    finally:
        await runner_pool.release(batch)
        await runner_pool.release(cutting)
    base = (await store.get_bases(Tenant(ns, knowledge_bases=("*",)), ["kb"]))[0]
    assert (base.embedder, base.generation) == ("target", 1)


async def test_deleting_a_base_cancels_a_migration_whose_start_it_waited_for(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool
) -> None:
    ns, migration, store = await migrating_base(pool, runner_pool)
    migrations = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    await migrations.transition(
        migration.id, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
    )
    starting = await pool.acquire()
    try:
        # A start that holds the base row FOR SHARE, not committed yet.
        await begin(starting, base_settings(ns))
        assert await starting.fetchval("SELECT knowledge_base_generation($1, 'kb')", ns) == 0
        second = str(uuid.uuid4())
        await starting.execute(
            "SELECT * FROM start_knowledge_migration($1, $2, 'kb', 0, 'target', 'target-model', 4, true, "
            "'fixed', 64, 0, 1, 'test')",
            second,
            ns,
        )
        deleting = asyncio.create_task(store.delete_base(Tenant(ns, knowledge_bases=("*",)), "kb"))
        await asyncio.sleep(0.3)
        assert not deleting.done(), "the delete did not wait for the start"
        await starting.execute("COMMIT")
        assert await deleting == 1
    finally:
        await pool.release(starting)
    ended = await migrations.get(second)
    assert ended is not None
    assert (ended.state, ended.reason) == (MigrationState.CANCELLED, "the knowledge base was deleted")


async def test_a_chunk_for_a_generation_that_is_gone_is_refused(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool
) -> None:
    ns, migration, _ = await migrating_base(pool, runner_pool)
    async with runner_pool.acquire() as runner:
        # Backfill "doc", then cut over as the runner does.
        await runner_writes_open(runner_pool, runner, migration)
        await runner.execute("COMMIT")
        await cut_over(runner, migration)
    async with pool.acquire() as conn:
        # A replica that never learnt of generations writes the column's default, 0.
        await begin(conn, base_settings(ns, "*"))
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.execute(
                "INSERT INTO chunks (namespace, kb_ref, doc_ref, version, chunk_index, text, start_offset, "
                "end_offset, dimension, embedding, text_config) VALUES ($1, 'kb', 'doc', 1, 5, 'stale', 0, 5, "
                "8, $2, 'simple')",
                ns,
                Vector(np.eye(8, dtype=np.float32)[0]),
            )
        assert refused.value.sqlstate == "TK003"
        await conn.execute("ROLLBACK")
    assert await generations(pool, ns) == [(0, 1, "version one", ""), (1, 1, "version one", "")]


async def cut_over(conn: PoolConnectionProxy[asyncpg.Record], migration: KnowledgeBaseMigration) -> None:
    """The cutover as the runner runs it, in a transaction of its own."""
    await begin(conn, base_settings(migration.namespace))
    assert await conn.fetchval("SELECT cut_over_knowledge_base($1, 'racer')", migration.id)
    await conn.execute("COMMIT")


async def _upload_pid(watcher: asyncpg.Connection) -> int:
    """The backend of the upload's transaction: the one session of the serving role inside a
    transaction (it holds its virtual transaction id). The role's sessions show no query text:
    track_activities is off for tokensvc's login roles."""
    for _ in range(200):
        pid = await watcher.fetchval(
            "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "AND l.locktype = 'virtualxid' AND l.granted "
            "WHERE a.usename LIKE 'tokensvc\\_app\\_%' AND a.backend_type = 'client backend' LIMIT 1"
        )
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.02)
    raise AssertionError("no upload is running")


async def test_the_clean_up_waits_for_an_upload_of_the_same_document(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, watcher: asyncpg.Connection
) -> None:
    """Both delete the document's old chunks: the clean-up locks the document row first, as the
    upload does, so one waits for the other instead of both locking chunk rows in their own order."""
    ns, migration, store = await migrating_base(pool, runner_pool)
    migrations = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    async with runner_pool.acquire() as conn:
        await runner_writes_open(runner_pool, conn, migration)
        await conn.execute("COMMIT")
        await cut_over(conn, migration)
    retiring = await migrations.get(migration.id)
    assert retiring is not None
    assert retiring.state is MigrationState.RETIRING
    uploading = await pool.acquire()
    clearing = await runner_pool.acquire()
    try:
        await begin(uploading, base_settings(ns, "*"))
        await uploading.fetchrow("SELECT * FROM document_write_state($1, 'kb', 'doc', NULL)", ns)
        await begin(clearing, base_settings(ns))
        await clearing.execute("SELECT lock_migration_subject($1, false)", migration.id)
        clear = asyncio.create_task(
            clearing.fetchval("SELECT kb_migration_clear($1, 'racer', 10, 60)", migration.id)
        )
        assert await waiting_for_a_lock(watcher, clearing.get_server_pid()), "the clean-up did not wait"
        await uploading.execute("COMMIT")
        assert await clear == 1  # generation 0's one chunk of "doc"
        await clearing.execute("COMMIT")
    finally:
        await pool.release(uploading)
        await runner_pool.release(clearing)
    assert await generations(pool, ns) == [(1, 1, "version one", "")]
    assert (await store.get_bases(Tenant(ns, knowledge_bases=("*",)), ["kb"]))[0].generation == 1
