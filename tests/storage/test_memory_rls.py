"""Row-level security, the second wall: what a query that forgets its bucket predicate can reach.

Everything runs as the serving role, through a pool opened the way the service opens it, with raw
SQL that deliberately leaves out the `bucket = $1` every store method carries.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import uuid
from collections.abc import AsyncIterator

import asyncpg
import numpy as np
import pytest

from tests.storage.migration_support import APP_ROLE
from tests.storage.search_support import bucket_size, vector_search
from tests.support import SharedDatabase, connect_as, service_settings, superuser
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.embedders import EmbedderSpec
from tokensvc.memory.models import MemorySpace, NewMemory
from tokensvc.retrieval import candidate_query
from tokensvc.storage.postgres import Database
from tokensvc.storage.postgres.memories import PostgresMemoryStore, search_statement
from tokensvc.storage.postgres.tenant import is_distributed, tenant_transaction
from tokensvc.storage.records import Tenant

DIM = 384
NAMESPACE = "rls-tests"


def new_bucket() -> str:
    return "v1." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")


def rows(count: int, label: str, *, ttl: int | None = None) -> list[NewMemory]:
    rng = np.random.default_rng()
    out = []
    for i in range(count):
        vector = rng.standard_normal(DIM).astype(np.float32)
        content = f"{label} {i} {uuid.uuid4()}"
        out.append(
            NewMemory(
                id=str(uuid.uuid4()),
                content=content,
                content_sha256=hashlib.sha256(content.encode()).digest(),
                metadata={"label": label},
                idempotency_key=None,
                ttl_seconds=ttl,
                embedding=vector / np.linalg.norm(vector),
            )
        )
    return out


async def open_pool(
    database: SharedDatabase, dev: DevPaths, factory: pytest.TempPathFactory, **overrides: object
) -> tuple[Database, asyncpg.Pool]:
    db = await locate_database(service_settings(database, dev, factory.mktemp("rls"), **overrides))
    return db, await db.open_pool()


@pytest.fixture(scope="module")
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    db, pool = await open_pool(database, dev, tmp_path_factory)
    try:
        yield pool
    finally:
        await db.close()


@pytest.fixture
def store(pool: asyncpg.Pool) -> PostgresMemoryStore:
    return PostgresMemoryStore(pool)


@pytest.fixture
async def two_buckets(store: PostgresMemoryStore) -> tuple[Tenant, Tenant]:
    """Bucket A with 3 live rows, bucket B (same agent, another user) with 2."""
    agent = f"agent-{uuid.uuid4().hex[:12]}"
    a = Tenant(NAMESPACE, agent, (new_bucket(),))
    b = Tenant(NAMESPACE, agent, (new_bucket(),))
    await store.insert(a, a.buckets[0], rows(3, "a"))
    await store.insert(b, b.buckets[0], rows(2, "b"))
    return a, b


async def test_a_query_without_the_bucket_predicate_sees_only_the_declared_buckets(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant]
) -> None:
    a, b = two_buckets

    async with tenant_transaction(pool, a) as conn:
        assert await conn.fetchval("SELECT count(*) FROM tokensvc.memories") == 3
        assert await conn.fetchval("SELECT array_agg(DISTINCT bucket) FROM memories") == list(a.buckets)
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE bucket = $1", b.buckets[0]) == 0
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE metadata->>'label' = 'b'") == 0
    both = Tenant(a.namespace, a.agent, (a.buckets[0], b.buckets[0]))
    async with tenant_transaction(pool, both) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 5


async def test_without_a_tenant_nothing_is_visible(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant]
) -> None:
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM tokensvc.memories") == 0
        async with conn.transaction():
            assert await conn.fetchval("SELECT count(*) FROM tokensvc.memories") == 0
        assert await conn.fetchval("SELECT count(*) FROM tokensvc.memory_spaces") == 0
    # An empty bucket list is "no tenant" too, not "every bucket".
    async with tenant_transaction(pool, Tenant(NAMESPACE, "nobody")) as conn:
        assert await conn.fetchval("SELECT count(*) FROM tokensvc.memories") == 0


async def test_writing_into_an_undeclared_bucket_is_refused(
    pool: asyncpg.Pool, store: PostgresMemoryStore, two_buckets: tuple[Tenant, Tenant]
) -> None:
    a, b = two_buckets
    row = rows(1, "smuggled")[0]
    insert = (
        "INSERT INTO memories (bucket, id, namespace, agent, content, content_sha256, dimension, embedding) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
    )
    args = (row.id, a.namespace, a.agent, row.content, row.content_sha256, DIM, row.embedding)

    async with tenant_transaction(pool, a) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.execute(insert, b.buckets[0], *args)
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.execute(insert, a.buckets[0], *args)
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await store.insert(a, b.buckets[0], [row])
    # Moving one of my rows into another bucket is a write into that bucket. Citus refuses any
    # change of the distribution column before row-level security is asked.
    async with tenant_transaction(pool, a) as conn:
        refused = (
            pytest.raises(asyncpg.FeatureNotSupportedError, match="partition value")
            if is_distributed(conn)
            else pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security")
        )
        with refused:
            await conn.execute("UPDATE memories SET bucket = $1", b.buckets[0])

    async with tenant_transaction(pool, b) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 2
    async with tenant_transaction(pool, a) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 3


async def test_update_and_delete_of_another_buckets_rows_affect_nothing(
    pool: asyncpg.Pool, store: PostgresMemoryStore, two_buckets: tuple[Tenant, Tenant]
) -> None:
    a, b = two_buckets
    async with tenant_transaction(pool, b) as conn:
        before = await conn.fetch("SELECT id, content, metadata, expires_at FROM memories ORDER BY id")

    async with tenant_transaction(pool, a) as conn:
        assert await conn.execute("UPDATE memories SET content = 'x' WHERE bucket = $1", b.buckets[0]) == (
            "UPDATE 0"
        )
        assert await conn.execute("DELETE FROM memories WHERE bucket = $1", b.buckets[0]) == "DELETE 0"
        ids = [row["id"] for row in before]
        assert await conn.execute("DELETE FROM memories WHERE id = ANY($1::uuid[])", ids) == "DELETE 0"
    # Through the store, with A's tenant and B's bucket (the predicate right, the tenant wrong).
    assert await store.delete(a, b.buckets[0], [str(i) for i in ids]) == 0
    assert await store.delete_all(a, b.buckets[0]) == 0
    assert await store.get(a, b.buckets[0], str(ids[0]), "test") is None
    assert await bucket_size(store, a, b.buckets[0], 100) == 0
    assert await store.move_buckets(a, a.buckets[0], b.buckets) == 0
    updated = await store.update(
        a, b.buckets[0], str(ids[0]), content=None, metadata={"x": 1}, ttl_seconds=0, embedder="test"
    )
    assert updated is None

    async with tenant_transaction(pool, b) as conn:
        assert (
            await conn.fetch("SELECT id, content, metadata, expires_at FROM memories ORDER BY id") == before
        )


async def test_a_pooled_connection_never_carries_the_previous_tenant(
    database: SharedDatabase,
    dev: DevPaths,
    tmp_path_factory: pytest.TempPathFactory,
    two_buckets: tuple[Tenant, Tenant],
) -> None:
    a, _ = two_buckets
    db, pool = await open_pool(database, dev, tmp_path_factory, pool_min_size=1, pool_max_size=1)
    try:
        async with tenant_transaction(pool, a) as conn:
            backend = await conn.fetchval("SELECT pg_backend_pid()")
            assert await conn.fetchval("SELECT current_setting('tokensvc.buckets', true)") == a.buckets[0]
            assert await conn.fetchval("SELECT count(*) FROM memories") == 3

        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == backend, "the same pooled connection"
            assert await conn.fetchval("SELECT current_setting('tokensvc.buckets', true)") in ("", None)
            assert await conn.fetchval("SELECT current_setting('tokensvc.agent', true)") in ("", None)
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0

        # The pool sends no reset query on release, so this rests on set_config(..., true) alone:
        # the scan settings and the deadline's statement_timeout are transaction-local too.
        default_timeout = await pool.fetchval("SELECT current_setting('statement_timeout')")
        scan = {"hnsw.ef_search": "77", "enable_sort": "off"}
        async with tenant_transaction(pool, a, settings=scan) as conn:
            assert await conn.fetchval("SELECT current_setting('hnsw.ef_search')") == "77"
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == backend
            assert await conn.fetchval("SELECT current_setting('hnsw.ef_search')") != "77"
            assert await conn.fetchval("SELECT current_setting('enable_sort')") == "on"
            assert await conn.fetchval("SELECT current_setting('statement_timeout')") == default_timeout
            assert not conn.is_in_transaction()

        # A transaction that fails half-way leaves nothing behind either.
        with pytest.raises(asyncpg.DivisionByZeroError):
            async with tenant_transaction(pool, a) as conn:
                await conn.execute("SELECT 1 / 0")
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == backend
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0

        # Nor does a search's transaction-local HNSW tuning outlive it.
        store = PostgresMemoryStore(pool)
        query = rows(1, "q")[0].embedding
        await vector_search(
            store,
            a,
            a.buckets[0],
            query,
            k=3,
            filter_=None,
            exact=False,
            ef_search=123,
            max_scan_tuples=4567,
            embedder="test",
        )
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == backend
            assert await conn.fetchval("SELECT current_setting('hnsw.ef_search', true)") != "123"
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0
    finally:
        await db.close()


async def test_the_serving_role_cannot_switch_row_level_security_off(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant]
) -> None:
    a, _ = two_buckets
    async with pool.acquire() as conn:
        role = await conn.fetchrow("SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user")
        assert (role["rolsuper"], role["rolbypassrls"]) == (False, False)
        owner = await conn.fetchval("SELECT tableowner FROM pg_tables WHERE tablename = 'memories'")
        assert owner != await conn.fetchval("SELECT current_user")
        for statement in (
            "ALTER TABLE tokensvc.memories DISABLE ROW LEVEL SECURITY",
            "ALTER TABLE tokensvc.memories NO FORCE ROW LEVEL SECURITY",
            "DROP POLICY memories_tenant ON tokensvc.memories",
            "CREATE POLICY everything ON tokensvc.memories USING (true)",
            "ALTER POLICY memories_tenant ON tokensvc.memories USING (true)",
            "ALTER TABLE tokensvc.memory_spaces DISABLE ROW LEVEL SECURITY",
            f"SET ROLE {owner}",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)

    # row_security = off does not turn RLS off for a role without BYPASSRLS: it makes the query fail.
    async with tenant_transaction(pool, a) as conn:
        await conn.execute("SET LOCAL row_security = off")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.fetchval("SELECT count(*) FROM memories")
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL row_security = off")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.fetchval("SELECT count(*) FROM memories")


# --- partitions (issue 15): reached through `memories` only ------------------------------------

PARTITIONS = 256


async def partition_of(pool: asyncpg.Pool, tenant: Tenant) -> str:
    """The partition that holds `tenant`'s bucket (all of it: the bucket is the partition key)."""
    async with tenant_transaction(pool, tenant) as conn:
        found = await conn.fetch("SELECT DISTINCT tableoid::regclass::text FROM memories")
    assert len(found) == 1, found
    name = str(found[0][0]).removeprefix("tokensvc.")
    assert re.fullmatch(r"memories_p\d{3}", name), name  # safe to put in a statement
    return name


async def test_memories_are_hash_partitioned_by_bucket_and_every_partition_is_locked_down(
    database: SharedDatabase,
) -> None:
    async with superuser(database) as conn:
        strategy = await conn.fetchval(
            "SELECT partstrat::text || ':' || pg_get_partkeydef(partrelid) FROM pg_partitioned_table "
            "WHERE partrelid = 'tokensvc.memories'::regclass"
        )
        partitions = await conn.fetch(
            "SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity, c.relacl::text AS acl, "
            "(SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid) AS policies "
            "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'tokensvc.memories'::regclass ORDER BY c.relname"
        )
    assert strategy == "h:HASH (bucket)"
    assert [row["relname"] for row in partitions] == [f"memories_p{p:03d}" for p in range(PARTITIONS)]
    for row in partitions:
        assert (row["relrowsecurity"], row["relforcerowsecurity"], row["policies"]) == (True, True, 0), row
        assert APP_ROLE not in (row["acl"] or ""), row  # the serving role holds no grant on it


async def test_a_partition_cannot_be_read_or_written_directly_even_by_its_tenant(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant], database: SharedDatabase
) -> None:
    a, _ = two_buckets
    partition = await partition_of(pool, a)
    bucket = a.buckets[0]
    async with tenant_transaction(pool, a) as conn:
        for statement in (
            f"SELECT count(*) FROM tokensvc.{partition}",  # noqa: S608 (a checked partition name)
            f"DELETE FROM tokensvc.{partition}",  # noqa: S608
            f"UPDATE tokensvc.{partition} SET content = 'x'",  # noqa: S608
            f"INSERT INTO tokensvc.{partition} (bucket) VALUES ('{bucket}')",  # noqa: S608
            # Nor can it build indexes through the owner's helper (only ensure_memory_vector_index).
            "SELECT tokensvc.build_memory_vector_index('memories', 7)",
        ):
            await conn.execute("SAVEPOINT attempt")  # so the next statement still runs
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
            await conn.execute("ROLLBACK TO SAVEPOINT attempt")
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE bucket = $1", bucket) == 3

    # The owner may read every row through `memories` (its statistics policy), none directly: the
    # partition's row-level security is forced and has no policy.
    async with connect_as(database.owner_credential_dir, database.dsn) as owner:
        assert await owner.fetchval("SELECT count(*) FROM memories WHERE bucket = $1", bucket) == 3
        assert await owner.fetchval(f"SELECT count(*) FROM tokensvc.{partition}") == 0  # noqa: S608


# Every kind of memory search: (text, exact, neighbours).
SEARCH_KINDS = [
    pytest.param(None, True, False, id="vector-exact"),
    pytest.param(None, False, False, id="vector-hnsw"),
    pytest.param("memory", True, False, id="text"),
    pytest.param("memory", True, True, id="hybrid-exact"),
    pytest.param("memory", False, True, id="hybrid-hnsw"),
]


@pytest.mark.parametrize(("text", "exact", "neighbours"), SEARCH_KINDS)
async def test_every_kind_of_bucket_search_reads_one_partition(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant], text: str | None, exact: bool, neighbours: bool
) -> None:
    """Each part of the statement (candidates, scores, neighbours) names the bucket, so the
    planner reads the bucket's partition only, not 256 (planned, locked and scanned)."""
    a, _ = two_buckets
    partition = await partition_of(pool, a)
    vector = rows(1, "q")[0].embedding
    query = candidate_query(vector=vector, text=text, k=5, rows=3, exact=exact, neighbours=neighbours)
    sql, params, settings = search_statement(a.buckets[0], query, None)
    async with tenant_transaction(pool, a, settings=settings) as conn:
        plan = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN {sql}", *params))
    assert set(re.findall(r"memories_p\d{3}", plan)) == {partition}, plan


async def test_repeated_bucket_statements_lock_one_partition_not_all(
    pool: asyncpg.Pool, two_buckets: tuple[Tenant, Tenant]
) -> None:
    """A prepared statement run again and again (as the pool runs every statement) keeps planning
    for its bucket: a generic plan would lock all 256 partitions on each execution."""
    a, _ = two_buckets
    partition = await partition_of(pool, a)
    vector = rows(1, "q")[0].embedding
    sql, params, settings = search_statement(
        a.buckets[0], candidate_query(vector=vector, text=None, k=5, rows=3, exact=True), None
    )
    count = "SELECT count(*) FROM (SELECT 1 FROM memories WHERE bucket = $1 LIMIT 5000) s"
    async with tenant_transaction(pool, a, settings=settings) as conn:
        for _ in range(8):  # past the five custom plans after which a generic one may be chosen
            await conn.fetch(sql, *params)
            await conn.fetchval(count, a.buckets[0])
        locked = await conn.fetch(
            "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = pg_backend_pid() AND c.relkind = 'r' AND c.relname LIKE 'memories_p%'"
        )
    assert {row[0] for row in locked} == {partition}


async def test_the_serving_role_has_the_tenant_policy_alone_and_the_runner_functions_need_a_lease(
    pool: asyncpg.Pool,
    store: PostgresMemoryStore,
    two_buckets: tuple[Tenant, Tenant],
    database: SharedDatabase,
) -> None:
    """No policy is OR-ed into a tenant query's row-level security (it would stop being an index
    condition); the re-embedding runner's owner functions are the runner role's alone (0021; they
    act only for a migration whose lease the caller holds: tests/storage/test_serving_role_attacks.py)."""
    async with superuser(database) as conn:
        policies = await conn.fetch(
            "SELECT polname FROM pg_policy WHERE polrelid = 'tokensvc.memories'::regclass "
            "AND (0 = ANY (polroles) OR $1::regrole = ANY (polroles))",
            APP_ROLE,
        )
    assert [row[0] for row in policies] == ["memories_tenant"]

    a, _ = two_buckets
    unknown = str(uuid.uuid4())
    async with pool.acquire() as conn:
        # The runner's functions: not the serving role's to call, whatever migration.
        for call in (
            "SELECT * FROM migration_pending($1::uuid, 'runner', NULL, NULL, 10)",
            "SELECT migration_clear($1::uuid, 'runner', 10, 5)",
            "SELECT migration_store($1::uuid, 'runner', '{}'::text[], '{}'::uuid[], '{}'::bytea[], '{}'::vector[])",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(call, unknown)
        # Counts only, never content, for a dry run.
        size = await conn.fetchrow("SELECT * FROM migration_space_size($1, $2)", NAMESPACE, a.agent)
        assert size["live"] == 5
    async with superuser(database) as conn:
        # The whole-table index build of 0013 is the owner's alone now.
        can_build = await conn.fetchval(
            "SELECT has_function_privilege($1, 'tokensvc.ensure_memory_vector_index(integer)', 'EXECUTE')",
            APP_ROLE,
        )
    assert can_build is False


async def pin_without_index(pool: asyncpg.Pool, tenant: Tenant, dim: int) -> None:
    """A space pinned to `dim` as a first write pins it, without the index build that follows."""
    async with tenant_transaction(pool, tenant) as conn:
        await conn.execute(
            "INSERT INTO memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
            "VALUES ($1, $2, 'hash', 'hash-v1', $3, true) ON CONFLICT DO NOTHING",
            tenant.namespace,
            tenant.agent,
            dim,
        )


async def test_a_new_dimensions_index_is_built_partition_by_partition_and_only_the_canonical_one(
    pool: asyncpg.Pool, store: PostgresMemoryStore, database: SharedDatabase
) -> None:
    """The serving role asks for a (slot, dimension) index one partition per call (each call its
    own transaction, so a build holds up one partition's writes); it cannot build anything else."""
    dim = 1999  # no other test uses it
    # Only for a dimension something uses (0021): a space pinned to it, not built here.
    await pin_without_index(pool, Tenant(NAMESPACE, f"dim-{dim}"), dim)
    await store.ensure_vector_index(dim, slot=1)
    async with superuser(database) as conn:
        built, transactions = await conn.fetchrow(
            "SELECT count(*), count(DISTINCT xmin::text) FROM pg_class "
            "WHERE relnamespace = 'tokensvc'::regnamespace AND relname ~ $1",
            rf"^memories_p\d{{3}}_hnsw_b_{dim}$",
        )
        valid = await conn.fetchval(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = $1::regclass",
            f"tokensvc.memories_hnsw_b_{dim}",
        )
    assert (built, transactions, valid) == (256, 256, True)  # one transaction per partition
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT memory_vector_index_ready($1, 1)", dim)
        for args in ((dim, 2, 0), (dim, 1, 256), (0, 1, 0), (dim, 1, -1)):
            assert not await conn.fetchval("SELECT ensure_memory_partition_index($1, $2, $3)", *args)


async def test_a_pinned_memory_space_cannot_be_changed_or_seen_by_another_agent(
    pool: asyncpg.Pool, store: PostgresMemoryStore
) -> None:
    tenant = Tenant(NAMESPACE, f"pinned-{uuid.uuid4().hex[:12]}")
    spec = MemorySpace(EmbedderSpec("hash", "hash-v1", DIM, True), "english")
    assert await store.pin_space(tenant, spec) == spec

    # Neither changed in place (no UPDATE privilege) nor deleted and pinned again (0021: no
    # policy lets a row be deleted), even by its own tenant.
    async with tenant_transaction(pool, tenant) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("UPDATE memory_spaces SET dimension = 256, model = 'other'")
    async with tenant_transaction(pool, tenant) as conn:
        assert await conn.execute("DELETE FROM memory_spaces") == "DELETE 0"
    other = Tenant(NAMESPACE, f"{tenant.agent}-other")
    async with tenant_transaction(pool, other) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memory_spaces") == 0
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.execute(
                "INSERT INTO memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
                "VALUES ($1, $2, 'x', 'x', 8, true)",
                tenant.namespace,
                f"{tenant.agent}-third",
            )

    assert await store.get_space(tenant) == spec
    assert await store.get_space(other) is None


async def test_the_sweeper_deletes_expired_rows_of_every_bucket_and_no_live_row(
    pool: asyncpg.Pool, store: PostgresMemoryStore
) -> None:
    agent = f"sweep-{uuid.uuid4().hex[:12]}"
    a = Tenant(NAMESPACE, agent, (new_bucket(),))
    b = Tenant(NAMESPACE, agent, (new_bucket(),))
    both = Tenant(NAMESPACE, agent, (a.buckets[0], b.buckets[0]))
    live = {tenant.buckets[0]: rows(2, "live") for tenant in (a, b)}
    for tenant in (a, b):
        await store.insert(tenant, tenant.buckets[0], [*live[tenant.buckets[0]], *rows(3, "old", ttl=0)])
    buckets = list(both.buckets)

    # A connection with no tenant cannot delete a live row, even when it names it.
    async with pool.acquire() as conn:
        live_ids = [row.id for bucket_rows in live.values() for row in bucket_rows]
        assert await conn.execute("DELETE FROM memories WHERE id = ANY($1::uuid[])", live_ids) == "DELETE 0"
    # Expired rows of other buckets stay invisible to the serving role, whatever it declares:
    # only the owner's sweep function sees them.
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT set_config('tokensvc.sweep', 'on', true)")
        assert (
            await conn.fetchval("SELECT count(*) FROM memories WHERE bucket = ANY($1::text[])", buckets) == 0
        )
        assert (
            await conn.execute("DELETE FROM memories WHERE bucket = ANY($1::text[])", buckets) == "DELETE 0"
        )
    async with tenant_transaction(pool, Tenant(NAMESPACE, agent, (new_bucket(),))) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE expires_at <= now()") == 0
    with pytest.raises(asyncpg.PostgresError, match="between 1 and 10000"):
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT sweep_expired_memories(0)")

    assert await store.sweep_expired(limit=1) == 1
    while await store.sweep_expired() > 0:
        pass  # other tests' expired rows go too; that is the sweeper's job

    async with tenant_transaction(pool, both) as conn:
        remaining = await conn.fetch("SELECT bucket, id::text FROM memories ORDER BY bucket")
    assert sorted((row[0], row[1]) for row in remaining) == sorted(
        (bucket, row.id) for bucket, bucket_rows in live.items() for row in bucket_rows
    )


async def test_extra_transaction_settings_cannot_override_the_declared_tenant(
    database: SharedDatabase,
    dev: DevPaths,
    tmp_path_factory: pytest.TempPathFactory,
    two_buckets: tuple[Tenant, Tenant],
) -> None:
    a, b = two_buckets
    db, pool = await open_pool(database, dev, tmp_path_factory)
    try:
        with pytest.raises(ValueError, match="from the Tenant only"):
            async with tenant_transaction(pool, a, settings={"tokensvc.buckets": b.buckets[0]}):
                pass
    finally:
        await db.close()
