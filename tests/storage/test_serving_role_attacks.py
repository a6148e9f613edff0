"""The serving role against the second wall (issue 35, F12): connected as the serving login role,
every path to rows outside the buckets its transaction declared is refused or answers nothing of
another bucket. And the runner role reaches tenant rows only through the runner's functions.

Each attack runs in a transaction that is rolled back, so an attack that got through on an older
schema leaves nothing behind; its effects are checked inside that transaction, as the attacker
would see them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import numpy as np
import pytest
from pgvector import Vector

from tests.storage.test_memory_rls import new_bucket
from tests.storage.test_reembedding_races import one_memory
from tests.support import SharedDatabase, connect_as, service_settings, superuser
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres import tenant
from tokensvc.storage.postgres.citus import citus_version
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.records import EmbedderSpec, MemorySpace, Tenant
from tokensvc.storage.reembedding_records import MemorySpaceMigration, MigrationState

NAMESPACE = "attacks"
SPACE = MemorySpace(EmbedderSpec("hash", "hash-v1", 8, True), "simple")
TARGET = EmbedderSpec("target", "target-model", 4, True)
# (function, arguments as SQL with $1 = a migration id): every function of the runner's.
RUNNER_CALLS = [
    ("migration_pending", "$1, 'attacker', NULL, NULL, 100"),
    (
        "migration_store",
        "$1, 'attacker', ARRAY['v1.x'], ARRAY[gen_random_uuid()], ARRAY['\\x00'::bytea], "
        "ARRAY['[1,0,0]'::vector]",
    ),
    ("migration_clear", "$1, 'attacker', 100, 60"),
    ("cut_over_memory_space", "$1, 'attacker'"),
    ("hold_migration", "$1, 'attacker'"),
    ("migration_progress", "$1, 'attacker', 0, NULL, NULL, NULL, 60"),
    ("lock_migration_subject", "$1, true"),
    ("kb_migration_pending", "$1, 'attacker', NULL, 100"),
    ("kb_migration_chunks", "$1, 'attacker', ARRAY['doc'], ARRAY[1::bigint]"),
    ("kb_migration_store", "$1, 'attacker', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}'"),
    ("kb_migration_clear", "$1, 'attacker', 100, 60"),
    ("cut_over_knowledge_base", "$1, 'attacker'"),
    ("claim_migration", "'attacker', 60, ARRAY['target'], 0, ARRAY[$1::uuid]"),
    # Background ingestion's (functions/ingestion.sql), $1 an ingestion's id.
    ("claim_ingestion", "'attacker', 60, ARRAY[$1::uuid]"),
    ("claim_this_ingestion", "'attacks', $1::uuid, 'attacker', 60"),
    ("renew_ingestion", "'attacks', $1::uuid, 'attacker', 60"),
    ("runner_ingestion", "'attacks', $1::uuid"),
    ("ingestion_failed", "'attacks', $1::uuid, 'attacker', 'x', 1"),
    ("fail_ingestion", "'attacks', $1::uuid, 'attacker', 'x'"),
    ("discard_ingestion", "'attacks', $1::uuid, 'attacker'"),
    ("ingestion_bytes", "'attacks', $1::uuid, 'attacker'"),
    ("ingestion_base", "'attacks', $1::uuid, 'attacker'"),
    (
        "stage_ingestion",
        "'attacks', $1::uuid, 'attacker', 0, NULL, 'x', NULL, 'text/plain', '{}', '{}', '{}', '{}', '{}', '{}', "
        "'{}'",
    ),
    ("ingestion_unembedded", "'attacks', $1::uuid, 'attacker', 10"),
    ("store_ingestion_vectors", "'attacks', $1::uuid, 'attacker', '{}', '{}', '{}'"),
    ("finish_ingestion", "'attacks', $1::uuid, 'attacker'"),
    # A base's text statistics (functions/text_statistics.sql): they weigh every search of it.
    ("count_text_statistics", "'attacks', $1::text, 1, 0.1, 1, 0.1"),
    ("renew_migration", "$1, 'attacker', 60"),
    ("rewind_migration", "$1, 'attacker'"),
    ("migration_failed", "$1, 'attacker', 'x', 1"),
    ("finish_migration", "$1, ARRAY['backfilling'], 'cancelled', 'x'"),
]
# Which role may execute each SECURITY DEFINER function (every one in the schema): what
# docs/architecture.md names, and nothing more.
SERVING, RUNNER, NOBODY = "serving", "runner", "nobody"
DEFINER_GRANTS = {
    "ensure_memory_vector_index": NOBODY,  # the owner's (0014 took it from the serving role)
    "ensure_memory_partition_index": SERVING,  # dimensions something uses only
    "ensure_chunk_vector_index": SERVING,  # likewise
    "memory_vector_index_ready": SERVING,  # the catalogue only
    "memory_rows_by_pepper_version": SERVING,  # counts
    "memory_rows_by_space": SERVING,  # counts
    "migration_space_size": SERVING,  # counts
    "sweep_expired_memories": SERVING,  # expired rows only, returns a count
    "memory_space_agents": SERVING,  # (namespace, agent) pairs for data-subject requests
    "knowledge_base_generation": SERVING,  # under the caller's row-level security
    "chunks_matching": SERVING,  # checks the caller's declared tenant itself (kb_visible)
    "memories_generation_guard": NOBODY,  # triggers
    "chunks_generation_guard": NOBODY,
    "start_memory_migration": SERVING,
    "start_knowledge_migration": SERVING,
    "release_started_migration": SERVING,
    "change_migration_state": SERVING,
    "cancel_knowledge_base_migrations": SERVING,
    "ingestion_queue": SERVING,  # counts
    "queue_ingestion": SERVING,  # an upload, in the declared tenant; never a lease or state
    "relabel_ingestion": SERVING,  # a queued version's metadata, in the declared tenant
    "held_ingestion": NOBODY,  # the ingestion functions' lease check
    **{name: RUNNER for name, _ in RUNNER_CALLS},
}


@pytest.fixture(autouse=True)
async def victims_migrations_finished(database: SharedDatabase) -> AsyncIterator[None]:
    """Every migration of this suite's namespace ends CANCELLED with its test, so no later
    service's runner has work left by it. Left BACKFILLING, a victim's migration is cancelled by
    a later clean-up (the API tests' cancel every unfinished one); CANCELLING, it is claimed
    before any newer migration (oldest first) and its slot cleared, which on Citus is a statement
    over every shard, seconds per victim, while the later test's own migration waits.

    Finishing one directly is the runner's own `finish_migration` (BACKFILLING to CANCELLED, as
    for a subject that is gone) without the clearing, which is sound for a migration nothing ever
    stored a vector for: its target embedder is one no service here has, so only a batch could
    have filled the target slot, and a batch counts its rows (`rows_done`). One that did is left
    as it is and fails the test. (A public name: the Citus suite re-runs this module with
    `import *`, which leaves out names starting with `_`.)"""
    yield
    async with superuser(database) as admin:
        await admin.execute(
            "UPDATE tokensvc.embedding_migrations SET state = 'cancelled', reason = 'the attack suite''s victim', "
            "lease_owner = NULL, lease_until = NULL, updated_at = statement_timestamp(), "
            "finished_at = statement_timestamp() "
            "WHERE namespace = $1 AND state IN ('backfilling', 'paused', 'cancelling') AND rows_done = 0",
            NAMESPACE,
        )
        unfinished = await admin.fetch(
            "SELECT id, state, rows_done FROM tokensvc.embedding_migrations WHERE namespace = $1 "
            "AND state IN ('backfilling', 'paused', 'retiring', 'cancelling')",
            NAMESPACE,
        )
    assert unfinished == []


@asynccontextmanager
async def in_a_transaction(
    credential_dir: Path, database: SharedDatabase
) -> AsyncIterator[asyncpg.Connection]:
    """A login role's connection of the class tokensvc's pools give it (`Database.open_pool`:
    on a Citus coordinator a `DistributedConnection`, whose declarations reach the workers), in a
    transaction rolled back afterwards."""
    async with connect_as(credential_dir, database.dsn) as probe:
        distributed = await citus_version(probe) is not None
    kind = tenant.DistributedConnection if distributed else asyncpg.Connection
    async with connect_as(credential_dir, database.dsn, connection_class=kind) as conn:
        await conn.execute("BEGIN")
        try:
            yield conn
        finally:
            await conn.execute("ROLLBACK")


@pytest.fixture
async def serving(database: SharedDatabase) -> AsyncIterator[asyncpg.Connection]:
    """The serving login role, in a transaction rolled back afterwards."""
    async with in_a_transaction(database.app_credential_dir, database) as conn:
        yield conn


@pytest.fixture
async def runner(database: SharedDatabase) -> AsyncIterator[asyncpg.Connection]:
    """The runner's login role, in a transaction rolled back afterwards."""
    async with in_a_transaction(database.runner_credential_dir, database) as conn:
        yield conn


class Victim:
    """Another tenant: a space pinned to 8 dimensions, one memory in one bucket, and (when asked)
    a migration of it that the serving role knows the id of (status RPCs show ids)."""

    def __init__(self, agent: str, bucket: str, migration: str | None):
        self.agent, self.bucket, self.migration = agent, bucket, migration


async def make_victim(pool: asyncpg.Pool, *, migrating: bool = False) -> Victim:
    memories = PostgresMemoryStore(pool)
    agent = f"victim-{uuid.uuid4().hex[:10]}"
    bucket = new_bucket()
    await memories.pin_space(Tenant(NAMESPACE, agent), SPACE)
    await memories.insert(
        Tenant(NAMESPACE, agent, (bucket,), generation=0), bucket, [one_memory("the victim's secret")]
    )
    migration = None
    if migrating:
        created = await PostgresEmbeddingMigrationStore(pool).create(
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
        migration = created.id
    return Victim(agent, bucket, migration)


async def declare(conn: asyncpg.Connection, **settings: str) -> None:
    """Declare `tokensvc.<name>` settings in the transaction as tokensvc declares a tenant (on
    Citus with `SET LOCAL`s that reach the workers, where the shards' policies read them): an
    attacker holding the serving role's credential can send the same statements."""
    await tenant.declare(conn, {f"tokensvc.{name}": value for name, value in settings.items()})


async def attempt(conn: asyncpg.Connection, sql: str, *args: object) -> list[asyncpg.Record] | None:
    """`sql` in a savepoint: its rows, or None when the database refused it (the transaction goes
    on, as an attacker's would)."""
    await conn.execute("SAVEPOINT attempt")
    try:
        rows = list(await conn.fetch(sql, *args))
    except (asyncpg.InsufficientPrivilegeError, asyncpg.InvalidParameterValueError):
        await conn.execute("ROLLBACK TO SAVEPOINT attempt")
        return None
    except asyncpg.PostgresError:
        await conn.execute("ROLLBACK TO SAVEPOINT attempt")
        raise
    await conn.execute("RELEASE SAVEPOINT attempt")
    return rows


def mentions(rows: list[asyncpg.Record] | None, value: str) -> bool:
    return any(value in str(field) for row in rows or [] for field in row.values())


async def victim_state(conn: asyncpg.Connection, victim: Victim) -> tuple[object, ...]:
    """The victim's pin and its memory's vectors, as a transaction that declared it sees them."""
    await declare(conn, namespace=NAMESPACE, agent=victim.agent, buckets=victim.bucket)
    space = await conn.fetchrow(
        "SELECT dimension, generation FROM memory_spaces WHERE agent = $1", victim.agent
    )
    memory = await conn.fetchrow(
        "SELECT dimension, embedding IS NOT NULL AS present FROM memories WHERE bucket = $1", victim.bucket
    )
    assert space is not None
    assert memory is not None
    return space["dimension"], space["generation"], memory["dimension"], memory["present"]


# --- forged and altered migration rows -------------------------------------------------------


async def test_a_forged_backfilling_row_reveals_no_other_bucket(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """F12 as reported: a forged BACKFILLING row with the attacker's own lease, then
    migration_pending, returned every bucket id and memory of the space."""
    victim = await make_victim(pool)
    forged = str(uuid.uuid4())
    inserted = await attempt(
        serving,
        "INSERT INTO embedding_migrations (id, namespace, agent, from_generation, from_embedder, from_model, "
        "from_dimension, to_embedder, to_model, to_dimension, to_normalized, state, created_by, lease_owner, "
        "lease_until) VALUES ($1, $2, $3, 0, 'hash', 'hash-v1', 8, 'x', 'x', 3, true, 'backfilling', 'x', "
        "'attacker', now() + interval '1 hour') RETURNING id",
        forged,
        NAMESPACE,
        victim.agent,
    )
    assert inserted is None
    await declare(serving, namespace=NAMESPACE, agent=victim.agent)
    read = await attempt(serving, "SELECT * FROM migration_pending($1, 'attacker', NULL, NULL, 100)", forged)
    assert read is None
    assert not mentions(read, victim.bucket)


async def test_a_forged_migration_cannot_re_pin_a_space_or_empty_its_vectors(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """F12: migration_store + cut_over_memory_space re-pinned a space to 3 dimensions; a forged
    RETIRING row + migration_clear emptied the vectors the space reads."""
    victim = await make_victim(pool)
    before = await victim_state(serving, victim)
    forged = str(uuid.uuid4())
    for state in ("backfilling", "retiring"):
        await attempt(
            serving,
            "INSERT INTO embedding_migrations (id, namespace, agent, from_generation, from_embedder, from_model, "
            "from_dimension, to_embedder, to_model, to_dimension, to_normalized, state, created_by, lease_owner, "
            "lease_until) VALUES ($1, $2, $3, 0, 'hash', 'hash-v1', 8, 'x', 'x', 3, true, $4, 'x', 'attacker', "
            "now() + interval '1 hour') ON CONFLICT (id) DO UPDATE SET state = $4",
            forged,
            NAMESPACE,
            victim.agent,
            state,
        )
        if state == "backfilling":
            await attempt(
                serving,
                "SELECT migration_store($1, 'attacker', ARRAY[$2], ARRAY[(SELECT id FROM memories WHERE bucket = $2)], "
                "ARRAY[(SELECT content_sha256 FROM memories WHERE bucket = $2)], ARRAY['[1,0,0]'::vector])",
                forged,
                victim.bucket,
            )
            await attempt(serving, "SELECT cut_over_memory_space($1, 'attacker')", forged)
        else:
            await attempt(serving, "SELECT migration_clear($1, 'attacker', 100, 60)", forged)
    assert await victim_state(serving, victim) == before == (8, 0, 8, True)


async def test_the_serving_role_cannot_update_a_finished_or_running_migration(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    running = await make_victim(pool, migrating=True)
    finished = await make_victim(pool, migrating=True)
    assert running.migration is not None
    assert finished.migration is not None
    store = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    try:
        assert await store.transition(
            finished.migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
        )
        for migration in (running.migration, finished.migration):
            revived = await attempt(
                serving,
                "UPDATE embedding_migrations SET state = 'backfilling', lease_owner = 'attacker', "
                "lease_until = now() + interval '1 hour', cursor_bucket = NULL WHERE id = $1 RETURNING id",
                migration,
            )
            assert revived is None
            # The operator's path moves a migration along the state machine only.
            for new_state in ("backfilling", "retiring", "succeeded", "cancelled", "paused"):
                moved = await attempt(
                    serving,
                    "SELECT id FROM change_migration_state($1, ARRAY['backfilling', 'paused', 'retiring', "
                    "'succeeded', 'cancelling', 'cancelled'], $2, 'x')",
                    migration,
                    new_state,
                )
                assert not moved, (migration, new_state)
    finally:
        # The attacker's transaction holds the spaces' rows: end it before cleaning up.
        await serving.execute("ROLLBACK")
        await serving.execute("BEGIN")
        await store.transition(
            running.migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
        )


async def test_the_serving_role_never_reads_the_backfill_cursor(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """The cursor holds a bucket id of the space being migrated."""
    assert await attempt(serving, "SELECT cursor_bucket, cursor_id FROM embedding_migrations LIMIT 1") is None
    assert await attempt(serving, "SELECT * FROM embedding_migrations LIMIT 1") is None
    served = await attempt(serving, "SELECT id, state, to_dimension FROM embedding_migrations LIMIT 1")
    assert served is not None


async def test_a_migration_starts_only_for_the_declared_space_from_its_real_pin(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    victim = await make_victim(pool)
    call = "SELECT * FROM start_memory_migration($1, $2, $3, 0, 'target', 'target-model', $4, true, 0, 'attacker')"
    # Not declared: refused.
    assert await attempt(serving, call, str(uuid.uuid4()), NAMESPACE, victim.agent, 3) is None
    # Declared: recorded, from the space's pin as the database has it, never the caller's.
    await declare(serving, namespace=NAMESPACE, agent=victim.agent)
    started = await attempt(serving, call, str(uuid.uuid4()), NAMESPACE, victim.agent, 3)
    assert started is not None
    (row,) = started
    assert (row["from_embedder"], row["from_dimension"], row["state"], row["lease_owner"]) == (
        "hash",
        8,
        "backfilling",
        "tokensvc:starting",  # until its start built the target's index and released it
    )
    assert row["cursor_bucket"] is None
    # A whole target only.
    assert await attempt(serving, call, str(uuid.uuid4()), NAMESPACE, victim.agent, 0) is None


@pytest.mark.parametrize(("function", "arguments"), RUNNER_CALLS, ids=[name for name, _ in RUNNER_CALLS])
async def test_the_serving_role_cannot_call_a_runner_function(
    pool: asyncpg.Pool, serving: asyncpg.Connection, function: str, arguments: str
) -> None:
    victim = await make_victim(pool, migrating=True)
    await declare(serving, namespace=NAMESPACE, agent=victim.agent)
    for migration in (victim.migration, str(uuid.uuid4())):  # real, and forged
        call = f"SELECT * FROM {function}({arguments})"  # noqa: S608 (the test's own constants)
        assert await attempt(serving, call, migration) is None


# --- index builds ----------------------------------------------------------------------------


async def test_index_builds_are_refused_for_a_dimension_nothing_uses(serving: asyncpg.Connection) -> None:
    assert await attempt(serving, "SELECT ensure_memory_partition_index(1993, 0, 0)") is None
    assert await attempt(serving, "SELECT ensure_memory_partition_index(1993, 1, 7)") is None
    assert await attempt(serving, "SELECT ensure_chunk_vector_index(1994)") is None
    created = await serving.fetchval(
        "SELECT count(*) FROM pg_class WHERE relname LIKE 'memories%hnsw%1993' OR relname = 'chunks_hnsw_1994'"
    )
    assert created == 0
    # A dimension a space is pinned to (384 always is: the embedded model) is still built.
    assert await serving.fetchval("SELECT ensure_memory_partition_index(384, 0, 0)") is True


# --- partitions, statistics and the other tables --------------------------------------------


async def test_partitions_and_statistics_show_no_bucket(
    pool: asyncpg.Pool, database: SharedDatabase, serving: asyncpg.Connection
) -> None:
    victim = await make_victim(pool)
    async with superuser(database) as admin:
        if tenant.is_distributed(serving):
            # The development cluster's Citus (15.0devel) fails the parallel ANALYZE of the
            # shards of memories' 256 partitions ("connection not open"); one connection per
            # worker analyzes them.
            await admin.execute("SET citus.multi_shard_modify_mode = 'sequential'")
        await admin.execute("ANALYZE tokensvc.memories")
    for partition in ("memories_p000", "memories_p128", "memories_p255"):
        assert await attempt(serving, f"SELECT bucket FROM {partition} LIMIT 1") is None  # noqa: S608
        assert await attempt(serving, f"DELETE FROM {partition}") is None  # noqa: S608
    # No row is visible without a declaration, nor in planner statistics (most common values).
    assert await serving.fetchval("SELECT count(*) FROM memories") == 0
    stats = await serving.fetch(
        "SELECT tablename, attname, most_common_vals::text, histogram_bounds::text FROM pg_stats "
        "WHERE schemaname = 'tokensvc' AND tablename LIKE 'memories%'"
    )
    assert not mentions(stats, victim.bucket)
    assert stats == []
    if tenant.is_distributed(serving):
        await the_shards_show_no_bucket(database, victim)


async def the_shards_show_no_bucket(database: SharedDatabase, victim: Victim) -> None:
    """On Citus the rows and their statistics are the shards', on the workers, where the serving
    role logs in too (Citus connects to them as it): there, with the shards shown, the partitions'
    shards are refused and no statistics are visible, though the superuser sees some."""
    name = urlsplit(database.dsn).path.strip("/")
    async with superuser(database) as admin:
        workers = await admin.fetch(
            "SELECT nodename, nodeport FROM pg_dist_node WHERE groupid <> 0 AND noderole = 'primary'"
        )
        shards = await admin.fetch(
            "SELECT nodename, nodeport, shard_name AS shard FROM citus_shards "
            "WHERE table_name IN ('tokensvc.memories_p000'::regclass, 'tokensvc.memories_p255'::regclass)"
        )
    assert workers != []
    assert shards != []
    statistics = (
        "SELECT tablename, most_common_vals::text, histogram_bounds::text FROM pg_stats "
        "WHERE schemaname = 'tokensvc' AND tablename LIKE 'memories%'"
    )
    seen_by_superuser = 0
    for worker in workers:
        where = {"host": worker["nodename"], "port": worker["nodeport"], "database": name}
        async with connect_as(database.superuser_credential_dir, **where) as admin:
            await admin.execute("SET citus.override_table_visibility = off")
            seen_by_superuser += len(await admin.fetch(statistics))
        async with connect_as(database.app_credential_dir, **where) as conn:
            await conn.execute("SET citus.override_table_visibility = off")
            assert await conn.fetch(statistics) == []
            for shard in shards:
                if (shard["nodename"], shard["nodeport"]) == (worker["nodename"], worker["nodeport"]):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.fetch(f"SELECT bucket FROM {shard['shard']} LIMIT 1")  # noqa: S608
    assert seen_by_superuser > 0


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE data_subject_receipts SET complete = true",
        "DELETE FROM data_subject_receipts",
        "TRUNCATE data_subject_receipts",
        "UPDATE audit_events SET detail = ''",
        "DELETE FROM audit_events",
        "TRUNCATE audit_events",
        "UPDATE capability_revocations SET reason = ''",
        "DELETE FROM capability_revocations",
        "UPDATE memory_spaces SET dimension = 3",
        "INSERT INTO schema_migrations (version, name, checksum) VALUES (999, 'x', 'x')",
        "DELETE FROM embedding_migrations",
        "ALTER TABLE memories DISABLE ROW LEVEL SECURITY",
    ],
)
async def test_the_serving_role_cannot_change_evidence_pins_or_policies(
    serving: asyncpg.Connection, statement: str
) -> None:
    assert await attempt(serving, statement) is None


async def test_the_serving_role_deletes_no_memory_space_even_its_declared_one(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """Deleting a space and pinning it again would re-pin it. The privilege stays (Citus locks a
    reference table's placements for an INSERT only for roles that may also delete), so the
    refusal is a restrictive policy: not one row goes, in the victim's own declaration either."""
    victim = await make_victim(pool, migrating=False)
    await declare(serving, namespace=NAMESPACE, agent=victim.agent)
    assert await attempt(serving, "DELETE FROM memory_spaces RETURNING namespace") == []
    assert await serving.fetchval("SELECT count(*) FROM memory_spaces") == 1


async def test_what_the_serving_role_reads_of_every_tenant_holds_no_bucket(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """Receipts, audit events, revocations, the agents of data-subject requests and the counts."""
    victim = await make_victim(pool, migrating=True)
    readable = [
        "SELECT * FROM data_subject_receipts",
        "SELECT * FROM audit_events ORDER BY id DESC LIMIT 500",
        "SELECT * FROM capability_revocations",
        "SELECT * FROM memory_space_agents(NULL, NULL, NULL, 10000)",
        "SELECT * FROM memory_rows_by_space()",
        "SELECT * FROM memory_rows_by_pepper_version()",
        "SELECT id, namespace, agent, state, reason, lease_owner, cursor_document FROM embedding_migrations",
    ]
    for sql in readable:
        rows = await attempt(serving, sql)
        assert rows is not None, sql
        assert not mentions(rows, victim.bucket), sql


# --- the grants, audited ---------------------------------------------------------------------


async def test_every_security_definer_function_is_executable_by_the_roles_the_design_names(
    database: SharedDatabase,
) -> None:
    async with superuser(database) as admin:
        rows = await admin.fetch(
            "SELECT p.proname, has_function_privilege('tokensvc_app', p.oid, 'EXECUTE') AS serving, "
            "has_function_privilege('tokensvc_runner', p.oid, 'EXECUTE') AS runner "
            "FROM pg_proc p WHERE p.pronamespace = 'tokensvc'::regnamespace AND p.prosecdef"
        )
    found = {}
    for row in rows:
        found[row["proname"]] = (
            SERVING
            if row["serving"] and not row["runner"]
            else RUNNER
            if row["runner"] and not row["serving"]
            else NOBODY
            if not row["serving"]
            else "both"
        )
    assert found == DEFINER_GRANTS


# --- the runner role -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT count(*) FROM memories",
        "SELECT count(*) FROM memories_p000",
        "SELECT count(*) FROM memory_spaces",
        "SELECT count(*) FROM knowledge_bases",
        "SELECT count(*) FROM documents",
        "SELECT count(*) FROM chunks",
        "SELECT count(*) FROM ingestions",
        "SELECT count(*) FROM ingestion_content",
        "SELECT count(*) FROM ingestion_chunks",
        "SELECT count(*) FROM text_statistics",
        "SELECT count(*) FROM common_lexemes",
        "SELECT * FROM ingestion_queue()",
        "SELECT count(*) FROM audit_events",
        "SELECT count(*) FROM data_subject_receipts",
        "INSERT INTO embedding_migrations (id) VALUES (gen_random_uuid())",
        "UPDATE embedding_migrations SET lease_owner = 'x'",
        "SELECT * FROM start_memory_migration(gen_random_uuid(), 'a', 'b', 0, 'x', 'x', 3, true, 0, 'x')",
        "SELECT * FROM change_migration_state(gen_random_uuid(), ARRAY['paused'], 'backfilling', '')",
        "SELECT * FROM memory_space_agents(NULL, NULL, NULL, 10)",
        "SELECT ensure_memory_partition_index(384, 0, 0)",
    ],
)
async def test_the_runner_role_reads_no_tenant_table(runner: asyncpg.Connection, statement: str) -> None:
    await declare(runner, namespace=NAMESPACE, agent="any", buckets=new_bucket(), kbs="*")
    assert await attempt(runner, statement) is None


async def test_the_runner_reads_a_space_only_with_its_lease_and_its_declaration(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, runner: asyncpg.Connection
) -> None:
    victim = await make_victim(pool, migrating=True)
    other = await make_victim(pool)
    assert victim.migration is not None
    store = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    try:
        read = "SELECT * FROM migration_pending($1, 'thief', NULL, NULL, 100)"
        # Without the lease: refused (TK002).
        await declare(runner, namespace=NAMESPACE, agent=victim.agent)
        with pytest.raises(asyncpg.PostgresError) as refused:
            await attempt(runner, read, victim.migration)
        assert refused.value.sqlstate == "TK002"
        # With the lease, in a transaction that declared another space: refused.
        await runner.execute(
            "SELECT * FROM claim_migration('thief', 60, ARRAY['target'], 0, "
            "(SELECT array_agg(id) FROM embedding_migrations WHERE id <> $1))",
            victim.migration,
        )
        await declare(runner, namespace=NAMESPACE, agent=other.agent)
        assert await attempt(runner, read, victim.migration) is None
        # Declared: the one space's memories, for the runner to embed.
        await declare(runner, namespace=NAMESPACE, agent=victim.agent)
        rows = await attempt(runner, read, victim.migration)
        assert rows is not None
        assert {row["bucket"] for row in rows} == {victim.bucket}
        assert not mentions(rows, other.bucket)
    finally:
        await runner.execute("ROLLBACK")
        await runner.execute("BEGIN")
        await store.transition(
            victim.migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
        )


async def test_a_forged_vector_of_another_dimension_is_refused_to_the_runner_too(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, runner: asyncpg.Connection
) -> None:
    """A stolen runner credential writes only vectors of the migration's target dimension, into
    the slot the space does not read yet; the cutover still checks every live memory."""
    victim = await make_victim(pool, migrating=True)
    assert victim.migration is not None
    store = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    try:
        await runner.execute(
            "SELECT * FROM claim_migration('thief', 60, ARRAY['target'], 0, "
            "(SELECT array_agg(id) FROM embedding_migrations WHERE id <> $1))",
            victim.migration,
        )
        await declare(runner, namespace=NAMESPACE, agent=victim.agent)
        with pytest.raises(asyncpg.PostgresError):
            await attempt(
                runner,
                "SELECT migration_store($1, 'thief', ARRAY[$2], ARRAY[(SELECT gen_random_uuid())], "
                "ARRAY['\\x00'::bytea], ARRAY[$3::vector])",
                victim.migration,
                victim.bucket,
                Vector(np.ones(3, dtype=np.float32)),
            )
        assert await runner.fetchval("SELECT cut_over_memory_space($1, 'thief')", victim.migration) is False
    finally:
        await runner.execute("ROLLBACK")
        await runner.execute("BEGIN")
        await store.transition(
            victim.migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
        )


# --- the control plane's functions, for the declared subject only ----------------------------


async def test_the_serving_role_cannot_cancel_resume_or_release_a_migration_it_did_not_declare(
    pool: asyncpg.Pool, runner_pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """change_migration_state and release_started_migration checked no declaration, and the
    subject's lock re-declared the caller's transaction as the victim's space."""
    victim = await make_victim(pool, migrating=True)
    assert victim.migration is not None
    store = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool)
    try:
        await declare(serving, namespace="someone-else", agent="attacker", kbs="*")
        for new_state in ("cancelling", "backfilling"):
            moved = await attempt(
                serving,
                "SELECT id FROM change_migration_state($1, ARRAY['backfilling', 'paused'], $2, 'x')",
                victim.migration,
                new_state,
            )
            assert moved is None, new_state
        assert (
            await attempt(serving, "SELECT id FROM release_started_migration($1)", victim.migration) is None
        )
        declared = await serving.fetchrow(
            "SELECT current_setting('tokensvc.namespace', true) AS ns, current_setting('tokensvc.agent', true) "
            "AS agent, current_setting('tokensvc.kbs', true) AS kbs"
        )
        assert declared is not None
        assert tuple(declared) == ("someone-else", "attacker", "*")
        state = await serving.fetchval(
            "SELECT state FROM embedding_migrations WHERE id = $1", victim.migration
        )
        assert state == "backfilling"
    finally:
        await serving.execute("ROLLBACK")
        await serving.execute("BEGIN")
        # The operator's own path (declaring the subject) still cancels it.
        cancelled = await store.transition(
            victim.migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLING
        )
        assert cancelled is not None
        await store.transition(
            victim.migration, expect=[MigrationState.CANCELLING], state=MigrationState.CANCELLED
        )


async def test_no_space_pinned_to_another_embedder_migrates_to_the_builtin_hash(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """An injection can declare any space (set_config) and start a migration of it; `hash` is the
    one target every deployment configures, so the service's own runner would carry it out."""
    agent = f"victim-{uuid.uuid4().hex[:10]}"
    await PostgresMemoryStore(pool).pin_space(
        Tenant(NAMESPACE, agent),
        MemorySpace(EmbedderSpec("e5", "multilingual-e5-small", 384, True), "simple"),
    )
    await declare(serving, namespace=NAMESPACE, agent=agent)
    started = await attempt(
        serving,
        "SELECT id FROM start_memory_migration($1, $2, $3, 0, 'hash', 'hash-v1', 384, true, 0, 'injected')",
        str(uuid.uuid4()),
        NAMESPACE,
        agent,
    )
    assert started is None


# --- index builds: a bounded number of dimensions ------------------------------------------


async def test_pins_the_serving_role_makes_up_get_indexes_for_16_dimensions_at_most(
    serving: asyncpg.Connection,
) -> None:
    """A pin the serving role inserts for a space of its own invention makes its dimension "used"
    (and it cannot be deleted again): each would get HNSW indexes on every partition."""
    refused = 0
    for dim in range(1960, 1990):
        await declare(serving, namespace="made-up", agent=f"fake-{dim}")
        await serving.execute(
            "INSERT INTO memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
            "VALUES ('made-up', $1, 'x', 'x', $2, true)",
            f"fake-{dim}",
            dim,
        )
        if await attempt(serving, "SELECT ensure_memory_partition_index($1, 0, 0)", dim) is None:
            refused += 1
    indexed = await serving.fetchval(
        "SELECT count(DISTINCT substring(relname FROM '([0-9]+)$')) FROM pg_class "
        "WHERE relnamespace = 'tokensvc'::regnamespace AND relname ~ '^memories_hnsw_(b_)?[0-9]+$'"
    )
    assert indexed <= 16
    assert refused >= 30 - 16
    # A dimension that has its indexes is still built on every partition.
    assert await serving.fetchval("SELECT ensure_memory_partition_index(384, 1, 5)") is True


async def test_no_session_of_the_serving_role_reads_the_buckets_another_one_declares(
    pool: asyncpg.Pool, serving: asyncpg.Connection
) -> None:
    """A transaction's first message declares its tenant's bucket ids as literals (one round trip:
    tokensvc/storage/postgres/tenant.py), and pg_stat_activity shows a session's last message to
    every session of the same role: the login roles run with track_activities off, which a
    session of theirs cannot turn back on (on Citus, on every node)."""
    bucket = new_bucket()
    async with tenant.tenant_transaction(pool, Tenant(NAMESPACE, "watched", (bucket,))) as victim:
        assert victim is not None  # its last message was its declaration; it waits there
        seen = await serving.fetch("SELECT pid, state, coalesce(query, '') AS query FROM pg_stat_activity")
        assert {row["state"] for row in seen if row["pid"] != serving.get_server_pid()} <= {"disabled", None}
        assert not [row for row in seen if bucket in row["query"]]
    assert await serving.fetchval("SHOW track_activities") == "off"
    if await citus_version(serving) is not None:
        on_workers = await serving.fetch(
            "SELECT success, result FROM run_command_on_workers('SHOW track_activities')"
        )
        assert on_workers
        assert {(row["success"], row["result"]) for row in on_workers} == {(True, "off")}
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await serving.execute("SET track_activities = on")


async def test_a_serving_login_with_track_activities_on_is_reported_at_start(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A database provisioned without the setting (docs/operations.md, "Database roles") still
    serves, and says at start what to run."""
    login = FileCredentialSource(database.app_credential_dir).read().username
    async with superuser(database) as admin:
        await admin.execute(f"ALTER ROLE {login} SET track_activities = on")
    try:
        for setting, warned in (("on", True), ("off", False)):
            async with superuser(database) as admin:
                await admin.execute(f"ALTER ROLE {login} SET track_activities = {setting}")
            caplog.clear()
            located = await locate_database(service_settings(database, dev, tmp_path / setting))
            try:
                with caplog.at_level(logging.WARNING, logger="tokensvc.storage.postgres.database"):
                    await located.open_pool()
            finally:
                await located.close()
            reported = [r.getMessage() for r in caplog.records if "track_activities" in r.getMessage()]
            assert bool(reported) is warned, reported
            if warned:
                assert login in reported[0]
                assert "ALTER ROLE" in reported[0]
    finally:
        async with superuser(database) as admin:
            await admin.execute(f"ALTER ROLE {login} SET track_activities = off")
