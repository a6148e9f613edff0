"""Vector-index builds started and not finished, and the duty that finishes them.

On Citus the first write of a new dimension only starts its index (a partition's build is 32
shards' there, minutes for all 256), and every replica's `vector-indexes` duty finishes it; on one
node the write builds it whole, and the duty finishes what a stopped replica left half done. The
Citus form of the write is checked here on a `DistributedConnection` pool (the declaration the
Citus way on the embedded PostgreSQL); tests/citus runs it on a real coordinator."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

import asyncpg
import numpy as np

from tests.conftest import ServiceFactory
from tests.storage.search_support import vector_search
from tests.storage.test_memory_rls import NAMESPACE, new_bucket, pin_without_index
from tests.storage.test_tenant_declaration import distributed_pool  # noqa: F401 - a fixture
from tests.support import SharedDatabase, superuser
from tokensvc.embedders import EmbedderSpec
from tokensvc.memory.models import MemorySpace, NewMemory
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.vector_indexes import PostgresVectorIndexes
from tokensvc.storage.records import Tenant
from tokensvc.supervision import finish_vector_indexes_forever


async def unused_dimension(database: SharedDatabase) -> int:
    """A dimension no index exists for, in a range no other test uses: each test here starts its
    own build, also on a Citus database the suite keeps between runs."""
    async with superuser(database) as conn:
        taken = {
            int(name.rsplit("_", 1)[1])
            for (name,) in await conn.fetch(
                "SELECT relname FROM pg_class WHERE relnamespace = 'tokensvc'::regnamespace"
                " AND relname ~ '^memories_hnsw_(b_)?[0-9]+$'"
            )
        }
    free = sorted(set(range(1000, 1990)) - taken)
    assert free, "every dimension of the range has an index"
    return free[np.random.default_rng().integers(len(free))]


async def built(database: SharedDatabase, parent: str) -> tuple[int, bool | None]:
    """(partitions indexed, whether the parent index is valid: None when it does not exist)."""
    async with superuser(database) as conn:
        children = await conn.fetchval(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)", f"tokensvc.{parent}"
        )
        valid = await conn.fetchval(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)", f"tokensvc.{parent}"
        )
    return int(children), valid


def memory(dimension: int, content: str) -> NewMemory:
    vector = np.random.default_rng().standard_normal(dimension).astype(np.float32)
    return NewMemory(
        id=str(uuid.uuid4()),
        content=content,
        content_sha256=hashlib.sha256(content.encode()).digest(),
        metadata={},
        idempotency_key=None,
        ttl_seconds=None,
        embedding=vector / np.linalg.norm(vector),
    )


async def wait_until_built(database: SharedDatabase, parent: str, running: asyncio.Task[None] | None) -> None:
    deadline = time.monotonic() + 900  # Citus: 1 to 2 s a partition
    while await built(database, parent) != (256, True):
        assert time.monotonic() < deadline, f"{parent} was not finished"
        assert running is None or not running.done()
        await asyncio.sleep(0.2)


async def test_a_first_write_on_citus_starts_the_index_and_the_duty_finishes_it(
    distributed_pool: asyncpg.Pool,  # noqa: F811 - the fixture imported above
    pool: asyncpg.Pool,
    database: SharedDatabase,
) -> None:
    dim = await unused_dimension(database)
    space = MemorySpace(EmbedderSpec("hash", "hash-v1", dim, True), "english")
    tenant = Tenant(NAMESPACE, f"new-dim-{uuid.uuid4().hex[:12]}", (new_bucket(),))
    store = PostgresMemoryStore(distributed_pool)
    assert await store.pin_space(tenant, space) == space
    assert await built(database, f"memories_hnsw_{dim}") == (1, False)  # partition 0 only
    indexes = PostgresVectorIndexes(pool)
    assert (dim, 0) in await indexes.unfinished()

    # Until the index is finished, a search is exact on the partitions it has not reached.
    written = memory(dim, "written before the index was finished")
    await store.insert(tenant, tenant.buckets[0], [written])
    for exact in (True, False):
        [found] = await vector_search(
            store,
            tenant,
            tenant.buckets[0],
            written.embedding,
            k=3,
            filter_=None,
            exact=exact,
            embedder="hash",
        )
        assert found.memory.id == written.id

    duty = asyncio.create_task(finish_vector_indexes_forever(indexes, 0.05))
    try:
        await wait_until_built(database, f"memories_hnsw_{dim}", duty)
    finally:
        duty.cancel()
    assert (dim, 0) not in await indexes.unfinished()
    [found] = await vector_search(
        store, tenant, tenant.buckets[0], written.embedding, k=3, filter_=None, exact=False, embedder="hash"
    )
    assert found.memory.id == written.id


async def test_a_running_service_finishes_a_build_a_stopped_replica_left(
    start_service: ServiceFactory, pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    dim = await unused_dimension(database)
    await pin_without_index(pool, Tenant(NAMESPACE, f"dim-{dim}"), dim)
    async with pool.acquire() as conn:  # a replica stopped after the first partition
        assert await conn.fetchval("SELECT ensure_memory_partition_index($1, 0, 0)", dim)
    assert await built(database, f"memories_hnsw_{dim}") == (1, False)
    await start_service()
    await wait_until_built(database, f"memories_hnsw_{dim}", None)


async def test_finish_completes_a_half_built_second_slot_index_and_ignores_other_indexes(
    pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    """A replica stopped after two partitions of a re-embedding target's index: `unfinished`
    names it by (dimension, slot) and `finish` builds the other 254. An invalid index of another
    name (an operator's, say) is not tokensvc's to build."""
    dim = await unused_dimension(database)
    await pin_without_index(pool, Tenant(NAMESPACE, f"dim-{dim}"), dim)
    async with pool.acquire() as conn:
        for part in (0, 1):
            assert await conn.fetchval("SELECT ensure_memory_partition_index($1, 1, $2)", dim, part)
    async with superuser(database) as conn:
        await conn.execute("CREATE INDEX operators_own_index ON ONLY tokensvc.memories (created_at)")
    try:
        indexes = PostgresVectorIndexes(pool)
        unfinished = await indexes.unfinished()
        assert (dim, 1) in unfinished
        assert unfinished == sorted(unfinished)
        assert (384, 0) not in unfinished  # the migrations built it whole
        await indexes.finish(dim, 1)
        assert await built(database, f"memories_hnsw_b_{dim}") == (256, True)
        assert (dim, 1) not in await indexes.unfinished()
        await indexes.finish(dim, 1)  # complete: nothing to do
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT memory_vector_index_ready($1, 1)", dim)
    finally:
        async with superuser(database) as conn:
            await conn.execute("DROP INDEX tokensvc.operators_own_index")
