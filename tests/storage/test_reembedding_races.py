"""The cutover against writes in flight, in PostgreSQL (migration 0014's locks, raced for real).

A write holds a share lock on its space's row from its first row to its commit; the cutover takes
that row FOR UPDATE. So a cutover waits for a write in flight and then sees its memory (which has
no target vector yet: the cutover refuses), and a write that starts while a cutover holds the row
waits, then finds the new generation and is refused (SQLSTATE TK001), never committing a memory
the new generation cannot find.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid

import asyncpg
import numpy as np
import pytest
from asyncpg.pool import PoolConnectionProxy

from tests.storage.migration_support import connect
from tests.storage.test_memory_rls import new_bucket
from tests.support import SharedDatabase
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.tenant import declare_settings, is_distributed
from tokensvc.storage.records import EmbedderSpec, MemorySpace, NewMemory, Tenant
from tokensvc.storage.reembedding_records import MemorySpaceMigration, MigrationState

NAMESPACE = "races"
SPACE = MemorySpace(EmbedderSpec("hash", "hash-v1", 8, True), "simple")
TARGET = EmbedderSpec("target", "target-model", 4, True)


def one_memory(content: str) -> NewMemory:
    vector = np.zeros(8, dtype=np.float32)
    vector[0] = 1.0
    return NewMemory(
        str(uuid.uuid4()), content, hashlib.sha256(content.encode()).digest(), {}, None, None, vector
    )


def space(tenant: Tenant) -> dict[str, str]:
    """The settings a runner's transaction declares for the space it migrates."""
    return {"tokensvc.namespace": tenant.namespace, "tokensvc.agent": tenant.agent}


async def ready_to_cut_over(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool
) -> tuple[Tenant, MemorySpaceMigration, PostgresEmbeddingMigrationStore]:
    """A space of one memory, fully backfilled, its runner holding the lease."""
    memories = PostgresMemoryStore(pool)
    migrations = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    agent = f"agent-{uuid.uuid4().hex[:12]}"
    tenant = Tenant(NAMESPACE, agent, (new_bucket(),), generation=0)
    await memories.pin_space(Tenant(NAMESPACE, agent), SPACE)
    await memories.insert(tenant, tenant.buckets[0], [one_memory("before the migration")])
    created = await migrations.create(
        MemorySpaceMigration(
            id=str(uuid.uuid4()),
            namespace=NAMESPACE,
            agent=agent,
            from_generation=0,
            source=SPACE.embedder,
            target=TARGET,
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
            break
        await migrations.transition(claimed.id, expect=[claimed.state], state=MigrationState.CANCELLED)
    pending = await migrations.pending(claimed, limit=10)
    stored = await migrations.store_vectors(
        claimed, "racer", [(p, np.array([1, 0, 0, 0], dtype=np.float32)) for p in pending], lease_seconds=60
    )
    assert stored is not None
    return tenant, stored, migrations


async def begin(
    conn: asyncpg.Connection | PoolConnectionProxy[asyncpg.Record], settings: dict[str, str]
) -> None:
    """Open a transaction with `settings` declared as the stores declare them (on Citus, so that
    the workers see them)."""
    await conn.execute(f"BEGIN; {declare_settings(settings, distributed=is_distributed(conn))}")


# The backend `pid` of the coordinator, or any worker backend of its distributed transaction
# (Citus gives them its global pid), waits for a lock.
_WAITING_ON_CITUS = (
    "SELECT 'Lock' FROM citus_stat_activity WHERE wait_event_type = 'Lock' AND global_pid = "
    "citus_calculate_gpid((SELECT nodeid FROM pg_dist_node WHERE groupid = 0), $1) LIMIT 1"
)


async def waiting_for_a_lock(watcher: asyncpg.Connection, pid: int) -> bool:
    """Whether the backend `pid` comes to wait for a lock (on Citus: on any node) within 4 s."""
    citus = await watcher.fetchval("SELECT count(*) = 1 FROM pg_extension WHERE extname = 'citus'")
    query = _WAITING_ON_CITUS if citus else "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
    for _ in range(200):
        if await watcher.fetchval(query, pid) == "Lock":
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_cutover_waits_for_a_write_in_flight_and_then_refuses_to_switch(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    tenant, migration, migrations = await ready_to_cut_over(pool, runner_pool)
    writer = await pool.acquire()
    watcher = await connect(database, "superuser", database.dsn.rsplit("/", 1)[1])
    try:
        settings = {
            "tokensvc.buckets": tenant.buckets[0],
            "tokensvc.namespace": tenant.namespace,
            "tokensvc.agent": tenant.agent,
            "tokensvc.generation": "0",
        }
        await begin(writer, settings)
        await writer.execute(
            "INSERT INTO memories (bucket, id, namespace, agent, content, content_sha256, dimension, embedding) "
            "VALUES ($1, gen_random_uuid(), $2, $3, 'written during the cutover', '\\x01', 8, $4)",
            tenant.buckets[0],
            tenant.namespace,
            tenant.agent,
            np.eye(8, dtype=np.float32)[1],
        )
        async with runner_pool.acquire() as cutting:
            pid = cutting.get_server_pid()
            await begin(cutting, space(tenant))  # what cut_over runs
            cut = asyncio.create_task(
                cutting.fetchval("SELECT cut_over_memory_space($1, 'racer')", migration.id)
            )
            assert await waiting_for_a_lock(watcher, pid), "the cutover did not wait for the write"
            await writer.execute("COMMIT")
            assert await cut is False  # the new memory has no target vector: no switch
            await cutting.execute("COMMIT")
    finally:
        await pool.release(writer)
        await watcher.close()
    waiting = await migrations.pending(dataclasses.replace(migration, cursor=None), limit=10)
    assert [p.content for p in waiting] == ["written during the cutover"]


async def test_a_write_that_waited_for_a_cutover_is_refused_as_stale(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    tenant, migration, _ = await ready_to_cut_over(pool, runner_pool)
    cutting = await runner_pool.acquire()
    writer = await pool.acquire()
    watcher = await connect(database, "superuser", database.dsn.rsplit("/", 1)[1])
    try:
        # The cutover runs to its commit; its transaction is held open meanwhile.
        await begin(cutting, space(tenant))
        assert await cutting.fetchval("SELECT cut_over_memory_space($1, 'racer')", migration.id)
        settings = {
            "tokensvc.buckets": tenant.buckets[0],
            "tokensvc.namespace": tenant.namespace,
            "tokensvc.agent": tenant.agent,
            "tokensvc.generation": "0",  # what a replica with the old pin declares
        }
        await begin(writer, settings)
        write = asyncio.create_task(
            writer.execute(
                "INSERT INTO memories (bucket, id, namespace, agent, content, content_sha256, dimension, "
                "embedding) VALUES ($1, gen_random_uuid(), $2, $3, 'an old-model write', '\\x02', 8, $4)",
                tenant.buckets[0],
                tenant.namespace,
                tenant.agent,
                np.eye(8, dtype=np.float32)[2],
            )
        )
        assert await waiting_for_a_lock(watcher, writer.get_server_pid()), (
            "the write did not wait for the cutover"
        )
        await cutting.execute("COMMIT")
        with pytest.raises(asyncpg.PostgresError) as refused:
            await write
        assert refused.value.sqlstate == "TK001"  # StaleMemorySpace, to the store's caller
        await writer.execute("ROLLBACK")
    finally:
        await runner_pool.release(cutting)
        await pool.release(writer)
        await watcher.close()
    rows = await PostgresMemoryStore(pool).list_page(
        Tenant(tenant.namespace, tenant.agent, tenant.buckets, generation=1),
        tenant.buckets[0],
        limit=10,
        after=None,
        filter_=None,
        embedder="x",
    )
    assert [r.content for r in rows] == ["before the migration"]


async def test_a_clean_up_batch_empties_its_memories_before_it_waits_and_rolls_back_without_the_lease(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    """Migration 0020: the batch's multi-shard UPDATE runs before the space and migration row
    locks (table locks on Citus), and a runner that lost its lease meanwhile empties nothing."""
    tenant, migration, _ = await ready_to_cut_over(pool, runner_pool)
    async with runner_pool.acquire() as cutting:
        await begin(cutting, space(tenant))
        assert await cutting.fetchval("SELECT cut_over_memory_space($1, 'racer')", migration.id)
        await cutting.execute("COMMIT")
    dbname = database.dsn.rsplit("/", 1)[1]
    holder = await connect(database, "superuser", dbname)
    watcher = await connect(database, "superuser", dbname)
    clearing = await runner_pool.acquire()
    try:
        await holder.execute("BEGIN")
        await holder.execute(
            "SELECT 1 FROM tokensvc.embedding_migrations WHERE id = $1 FOR UPDATE", migration.id
        )
        await begin(clearing, space(tenant))  # what clear_slot runs
        clear = asyncio.create_task(
            clearing.fetchval("SELECT migration_clear($1, 'racer', 10, 60)", migration.id)
        )
        assert await waiting_for_a_lock(watcher, clearing.get_server_pid()), "the batch did not wait"
        # The batch's memory is updated already (locked by the waiting batch), not after the wait.
        with pytest.raises(asyncpg.LockNotAvailableError):
            await watcher.execute(
                "SELECT 1 FROM tokensvc.memories WHERE bucket = $1 AND agent = $2 FOR UPDATE NOWAIT",
                tenant.buckets[0],
                tenant.agent,
            )
        # Meanwhile another runner takes the lease: the batch refuses, and its UPDATE rolls back.
        await holder.execute(
            "UPDATE tokensvc.embedding_migrations SET lease_owner = 'other' WHERE id = $1", migration.id
        )
        await holder.execute("COMMIT")
        with pytest.raises(asyncpg.PostgresError) as refused:
            await clear
        assert refused.value.sqlstate == "TK002"
        await clearing.execute("ROLLBACK")
    finally:
        await runner_pool.release(clearing)
        await holder.close()
        await watcher.close()
    async with pool.acquire() as conn:
        await begin(conn, {**space(tenant), "tokensvc.buckets": tenant.buckets[0]})
        slots = await conn.fetch("SELECT dimension, dimension_b FROM memories WHERE agent = $1", tenant.agent)
        await conn.execute("COMMIT")
    assert [tuple(row) for row in slots] == [(8, 4)]  # the old generation's vector is still there
