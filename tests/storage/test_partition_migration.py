"""Migration 0013 (memories hash-partitioned by bucket) on a database populated under 0001-0012:
every row is kept exactly, every constraint and index is there again, row-level security and the
sweep behave as before (issue 15)."""

from __future__ import annotations

import asyncio
import hashlib

import asyncpg
import pytest

from tests.storage.migration_support import APP_ROLE, connect, migrate_through, migrate_up_to
from tests.support import SharedDatabase
from tokensvc.storage.postgres import apply_schema_migrations

UNIT_8 = "[" + ",".join(["0.35355339"] * 8) + "]"
BUCKETS = [f"v1.bucket{b:03d}" for b in range(40)]
ROWS_PER_BUCKET = 25
EXPIRED_PER_BUCKET = 3
# Every column of a row, the generated tsvector included: what must survive the copy exactly.
SNAPSHOT = "SELECT md5(string_agg(m::text, E'\\n' ORDER BY bucket, id)), count(*) FROM tokensvc.memories m"


def tenant(buckets: list[str], agent: str = "agent") -> str:
    return (
        f"SELECT set_config('tokensvc.namespace', 'ns', true), set_config('tokensvc.agent', '{agent}', true), "
        f"set_config('tokensvc.buckets', '{','.join(buckets)}', true)"
    )


async def populate(conn: asyncpg.Connection) -> None:
    """Two memory spaces of different dimensions; live, expired, keyed and `simple` rows."""
    async with conn.transaction():
        for agent, dim in (("agent", 256), ("agent-small", 8)):
            await conn.execute(tenant(BUCKETS, agent))
            await conn.execute(
                "INSERT INTO tokensvc.memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
                "VALUES ('ns', $1, 'hash', 'hash-v1', $2, true)",
                agent,
                dim,
            )
            await conn.execute("SELECT tokensvc.ensure_memory_vector_index($1)", dim)  # as pin_space does
        await conn.execute(
            "INSERT INTO tokensvc.memories (bucket, id, namespace, agent, content, content_sha256, metadata, "
            "idempotency_key, dimension, embedding, expires_at, text_config) "
            "SELECT b, gen_random_uuid(), 'ns', CASE WHEN b < 'v1.bucket020' THEN 'agent' ELSE 'agent-small' END, "
            "'memory ' || i || ' of ' || b, sha256((b || i)::bytea), jsonb_build_object('i', i, 'odd', i % 2 = 1), "
            "CASE WHEN i % 5 = 0 THEN 'key-' || i END, d, "
            "array_fill((1 / sqrt(d))::real, ARRAY[d])::vector, "
            "CASE WHEN i <= $2 THEN now() - interval '1 hour' END, "
            "CASE WHEN i % 7 = 0 THEN 'simple' ELSE 'english' END::regconfig "
            "FROM unnest($1::text[]) b, generate_series(1, $3) i, "
            "LATERAL (SELECT CASE WHEN b < 'v1.bucket020' THEN 256 ELSE 8 END AS d) dims",
            BUCKETS,
            EXPIRED_PER_BUCKET,
            ROWS_PER_BUCKET,
        )


async def catalogue(conn: asyncpg.Connection) -> dict[str, list[tuple[object, ...]]]:
    """What guards `memories`: its policies, its grants, and the functions that reach into it."""
    queries = {
        "policies": "SELECT polname, polcmd, polroles::regrole[]::text, pg_get_expr(polqual, polrelid), "
        "pg_get_expr(polwithcheck, polrelid) FROM pg_policy WHERE polrelid = 'tokensvc.memories'::regclass "
        "ORDER BY polname",
        "grants": "SELECT relacl::text, relrowsecurity, relforcerowsecurity FROM pg_class "
        "WHERE oid = 'tokensvc.memories'::regclass",
        "functions": "SELECT proname, prosecdef, proconfig::text, proacl::text, pg_get_userbyid(proowner) "
        "FROM pg_proc WHERE pronamespace = 'tokensvc'::regnamespace AND proname IN "
        "('ensure_memory_vector_index', 'sweep_expired_memories', 'memory_rows_by_space', "
        "'memory_rows_by_pepper_version') ORDER BY proname",
    }
    return {name: [tuple(row) for row in await conn.fetch(sql)] for name, sql in queries.items()}


async def test_migration_0013_keeps_every_row_index_and_guarantee(
    database: SharedDatabase, scratch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = await connect(database, "owner", scratch)
    try:
        await migrate_up_to(owner, 12, monkeypatch)
        await populate(owner)
        async with owner.transaction():
            await owner.execute(tenant(BUCKETS))
            before = tuple(await owner.fetchrow(SNAPSHOT))
        assert before[1] == len(BUCKETS) * ROWS_PER_BUCKET

        guarantees = await catalogue(owner)
        applied = await migrate_through(owner, 13, monkeypatch)
        assert [m.version for m in applied] == [13]
        # The same policies (roles, USING and WITH CHECK), grants and function properties.
        assert await catalogue(owner) == guarantees

        async with owner.transaction():
            await owner.execute(tenant(BUCKETS))
            assert tuple(await owner.fetchrow(SNAPSHOT)) == before
            spread = await owner.fetchval("SELECT count(DISTINCT tableoid) FROM tokensvc.memories")
        assert spread > 30  # 40 buckets over 256 partitions

        indexes = {
            row[0]: row[1]
            for row in await owner.fetch(
                "SELECT i.relname, count(c.inhrelid) FROM pg_class i LEFT JOIN pg_inherits c "
                "ON c.inhparent = i.oid WHERE i.relnamespace = 'tokensvc'::regnamespace AND i.relkind = 'I' "
                "AND i.relname LIKE 'memories%' GROUP BY 1"
            )
        }
        # Every index of 0003/0009 again, on all 256 partitions; HNSW for every pinned dimension.
        for name in (
            "memories_pkey",
            "memories_bucket_content_sha256_key",
            "memories_idempotency",
            "memories_newest",
            "memories_text",
            "memories_expiry",
            "memories_hnsw_256",
            "memories_hnsw_384",
            "memories_hnsw_8",
        ):
            assert indexes.get(name) == 256, (name, indexes)

        async with owner.transaction():
            await owner.execute(tenant(BUCKETS[:1]))
            # Unique keys hold per bucket, exactly as before: the content of row 1, the key of row 5.
            taken = hashlib.sha256(b"v1.bucket0001").digest()
            for sha256, key in ((taken, None), (hashlib.sha256(b"new").digest(), "key-5")):
                with pytest.raises(asyncpg.UniqueViolationError):
                    async with owner.transaction():
                        await owner.execute(
                            "INSERT INTO tokensvc.memories (bucket, id, namespace, agent, content, "
                            "content_sha256, idempotency_key, dimension, embedding) VALUES ('v1.bucket000', "
                            "gen_random_uuid(), 'ns', 'agent', 'dup', $1, $2, 8, $3::vector)",
                            sha256,
                            key,
                            UNIT_8,
                        )
        # Row-level security, as the serving role (the owner reads every row through its
        # statistics policy): one declared bucket, its rows only.
        app = await connect(database, "app", scratch)
        try:
            async with app.transaction():
                await app.execute(tenant(BUCKETS[:1]))
                assert await app.fetchval("SELECT count(*) FROM tokensvc.memories") == ROWS_PER_BUCKET
                assert await app.fetchval("SELECT count(DISTINCT bucket) FROM tokensvc.memories") == 1
            # The sweep removes the expired rows of every bucket, and nothing else.
            swept = await app.fetchval("SELECT tokensvc.sweep_expired_memories(10000)")
            assert swept == len(BUCKETS) * EXPIRED_PER_BUCKET
        finally:
            await app.close()
        async with owner.transaction():
            await owner.execute(tenant(BUCKETS))
            left = await owner.fetchval("SELECT count(*) FROM tokensvc.memories WHERE expires_at IS NULL")
        assert left == len(BUCKETS) * (ROWS_PER_BUCKET - EXPIRED_PER_BUCKET)
    finally:
        await owner.close()


async def test_a_write_open_when_migration_0013_starts_is_copied_not_lost(
    database: SharedDatabase, scratch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas keep serving while the schema migration Job runs. A Remember whose transaction is open when
    the migration starts must end up in the new table: the migration waits for it before it copies
    (without that, the copy would miss the row, and its commit would land in the dropped table)."""
    owner = await connect(database, "owner", scratch)
    app = await connect(database, "app", scratch)
    watcher = await connect(database, "superuser", scratch)
    try:
        await migrate_up_to(owner, 12, monkeypatch)
        await populate(owner)
        writer = app.transaction()
        await writer.start()
        await app.execute(tenant(BUCKETS[:1]))
        await app.execute(
            "INSERT INTO tokensvc.memories (bucket, id, namespace, agent, content, content_sha256, "
            "dimension, embedding) VALUES ('v1.bucket000', gen_random_uuid(), 'ns', 'agent', "
            "'written during the migration', $1, 8, $2::vector)",
            hashlib.sha256(b"during").digest(),
            UNIT_8,
        )
        migrating = owner.get_server_pid()
        migration = asyncio.create_task(apply_schema_migrations(owner, app_role=APP_ROLE))
        for _ in range(400):  # until the migration waits for the writer's lock
            await asyncio.sleep(0.05)
            waiting = await watcher.fetchval(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", migrating
            )
            if waiting == "Lock":
                break
        assert waiting == "Lock", "the migration never waited for the open write"
        await writer.commit()
        assert [m.version for m in (await migration)[:1]] == [13]
        async with app.transaction():
            await app.execute(tenant(BUCKETS[:1]))
            found = await app.fetchval(
                "SELECT count(*) FROM tokensvc.memories WHERE content = 'written during the migration'"
            )
            total = await app.fetchval("SELECT count(*) FROM tokensvc.memories")
        assert (found, total) == (1, ROWS_PER_BUCKET + 1)
    finally:
        await watcher.close()
        await app.close()
        await owner.close()
