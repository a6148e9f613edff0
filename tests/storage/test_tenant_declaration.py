"""The Citus form of the tenant declaration (`SET LOCAL`s in a `DO` block), checked on the embedded
PostgreSQL, where it must hold the same guarantees as `set_config(..., true)`: the tenant only for
its transaction, no value that can leave the block. tests/citus runs it on a real coordinator."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pgvector.asyncpg import register_vector

from tests.storage.test_memory_rls import NAMESPACE, new_bucket, rows
from tests.support import SharedDatabase
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.tenant import DistributedConnection, declare_settings, tenant_transaction
from tokensvc.storage.records import Tenant


@pytest.fixture
async def distributed_pool(database: SharedDatabase) -> AsyncIterator[asyncpg.Pool]:
    """A pool of the serving role whose connections declare tenants the Citus way."""
    credential = FileCredentialSource(database.app_credential_dir).read()

    async def init(conn: asyncpg.Connection) -> None:
        await register_vector(conn, schema="public")
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")

    pool = await asyncpg.create_pool(
        database.dsn,
        user=credential.username,
        password=credential.password,
        min_size=1,
        max_size=1,  # one connection: the second transaction reuses the first one's
        connection_class=DistributedConnection,
        server_settings={"search_path": "tokensvc, public"},
        init=init,
    )
    try:
        yield pool
    finally:
        await pool.close()


async def test_set_local_declares_the_tenant_for_its_transaction_only(distributed_pool: asyncpg.Pool) -> None:
    store = PostgresMemoryStore(distributed_pool)
    agent = f"agent-{uuid.uuid4().hex[:12]}"
    mine, theirs = Tenant(NAMESPACE, agent, (new_bucket(),)), Tenant(NAMESPACE, agent, (new_bucket(),))
    await store.insert(mine, mine.buckets[0], rows(2, "mine"))
    await store.insert(theirs, theirs.buckets[0], rows(3, "theirs"))
    async with tenant_transaction(
        distributed_pool, mine, lock="a lock's key", settings={"hnsw.ef_search": "50"}
    ) as conn:
        assert await conn.fetchval("SELECT current_setting('tokensvc.buckets')") == mine.buckets[0]
        assert await conn.fetchval("SELECT current_setting('hnsw.ef_search')") == "50"
        assert await conn.fetchval("SELECT count(*) FROM memories") == 2  # no bucket predicate
    async with distributed_pool.acquire() as conn:
        assert await conn.fetchval("SELECT current_setting('tokensvc.buckets', true)") in (None, "")
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0


async def test_a_value_that_could_end_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not a setting"):
        declare_settings({"tokensvc.kbs": "kb$tokensvc_tenant$; RESET ALL; --"}, distributed=True)
    with pytest.raises(ValueError, match="not a setting"):
        declare_settings({"tokensvc.kbs = 'x'; RESET ALL; SET a.b": "kb"}, distributed=True)
