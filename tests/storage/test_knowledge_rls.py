"""Row-level security on the knowledge tables: queries that forget their predicate still see only
the namespace and the knowledge bases their transaction declared. The bytes and staged chunks of
background ingestion the serving role cannot read at all, and the runner role reaches them only
through its lease-checking functions, under the declared namespace too."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import numpy as np
import pytest

from tests.storage.test_memory_rls import open_pool
from tests.support import SharedDatabase, connect_as, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.ingestion_records import Extracted, Ingestion, StagedChunk
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.tenant import is_distributed, tenant_transaction
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, BaseRow, ChunkRow, Tenant

# The tables the serving role reads.
TABLES = ("knowledge_bases", "documents", "chunks", "ingestions")
# One corpus's rows in each (`corpus`).
CORPUS = {"knowledge_bases": 1, "documents": 1, "chunks": 2, "ingestions": 1}
RUNNER = "rls-runner"


@pytest.fixture(scope="module")
async def database_pools(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[asyncpg.Pool, asyncpg.Pool]]:
    """The serving role's pool and the runner role's."""
    db, pool = await open_pool(database, dev, tmp_path_factory)
    try:
        source = db.target.runner_credentials
        assert source is not None
        yield pool, await db.open_runner_pool(source.read, 2)
    finally:
        await db.close()


@pytest.fixture(scope="module")
def pool(database_pools: tuple[asyncpg.Pool, asyncpg.Pool]) -> asyncpg.Pool:
    return database_pools[0]


@pytest.fixture(scope="module")
def ingestion(database_pools: tuple[asyncpg.Pool, asyncpg.Pool]) -> PostgresIngestionStore:
    return PostgresIngestionStore(*database_pools)


@pytest.fixture(autouse=True)
async def corpora_deleted(pool: asyncpg.Pool) -> AsyncIterator[None]:
    """The test's corpora are deleted after it: their queued versions leave the shared queue."""
    yield
    store = PostgresKnowledgeStore(pool)
    while CORPORA:
        namespace, ref = CORPORA.pop()
        await store.delete_base(Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,)), ref)


CORPORA: list[tuple[str, str]] = []


async def corpus(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, namespace: str, ref: str
) -> Ingestion:
    """One knowledge base with one document of two chunks, and its next version on its way in
    with two chunks staged (leased to RUNNER)."""
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
    job = await ingestion.claim_one(enqueued.ingestion, RUNNER, lease_seconds=60)
    assert job is not None
    staged = [StagedChunk(i, f"next {i}", 0, 6, ()) for i in range(2)]
    extracted = await ingestion.store_extraction(
        job, RUNNER, Extracted("next version", (), "text/plain", staged, 0)
    )
    assert extracted is not None
    return extracted


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
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore
) -> None:
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, ours, "kb1")
    await corpus(pool, ingestion, ours, "kb2")
    await corpus(pool, ingestion, theirs, "kb1")

    assert await counts(pool, Tenant(ours, knowledge_bases=("kb1",))) == CORPUS
    assert await counts(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) == {
        table: 2 * n for table, n in CORPUS.items()
    }
    assert await counts(pool, Tenant(ours)) == dict.fromkeys(TABLES, 0)
    assert await counts(pool, None) == dict.fromkeys(TABLES, 0)


async def test_writes_outside_the_declared_namespace_are_refused(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore
) -> None:
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, theirs, "kb1")
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
        assert await conn.execute("DELETE FROM ingestions WHERE namespace = $1", theirs) == "DELETE 0"
    assert await counts(pool, Tenant(theirs, knowledge_bases=("kb1",))) == CORPUS


@pytest.mark.parametrize("table", ["ingestion_content", "ingestion_chunks"])
async def test_the_serving_role_cannot_read_an_uploads_bytes_or_staged_chunks(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, table: str
) -> None:
    namespace = f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, namespace, "kb1")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with tenant_transaction(
            pool, Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))
        ) as conn:
            await conn.fetchval(f"SELECT count(*) FROM {table}")  # noqa: S608


async def test_the_serving_role_cannot_write_a_lease_or_a_state(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore
) -> None:
    """What the runner's functions trust of an ingestion row (its lease, state and progress)
    the serving role cannot forge, in its own namespace either."""
    namespace = f"rls-{uuid.uuid4().hex[:8]}"
    job = await corpus(pool, ingestion, namespace, "kb1")
    tenant = Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))
    for statement in (
        "UPDATE ingestions SET lease_owner = 'forger', lease_until = now() + interval '1 hour'",
        "UPDATE ingestions SET state = 'processing', chunks_total = 0, generation = 0",
        "UPDATE ingestions SET chunks_done = chunks_total",
        "INSERT INTO ingestions (namespace, id, kb_ref, doc_ref, version, content_type, content_sha256, "
        "size_bytes, lease_owner, lease_until) SELECT namespace, gen_random_uuid(), kb_ref, 'forged', 9, "
        "content_type, content_sha256, 1, 'forger', now() + interval '1 hour' FROM ingestions",
        "INSERT INTO ingestions (namespace, id, kb_ref, doc_ref, version, content_type, content_sha256, "
        "size_bytes) SELECT namespace, gen_random_uuid(), kb_ref, 'forged', 9, content_type, content_sha256, 1 "
        "FROM ingestions",
        "UPDATE ingestion_content SET content = 'forged'",
        "INSERT INTO ingestion_content (namespace, ingestion, kb_ref, content) "
        "SELECT namespace, gen_random_uuid(), kb_ref, 'forged' FROM ingestions",
        "INSERT INTO ingestion_chunks (namespace, ingestion, kb_ref, chunk_index, text, start_offset, end_offset) "
        "SELECT namespace, id, kb_ref, 9, 'forged', 0, 6 FROM ingestions",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with tenant_transaction(pool, tenant) as conn:
                await conn.execute(statement)
    assert await ingestion.get(job) == job


async def test_the_serving_roles_queue_functions_work_only_in_its_declared_tenant(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore
) -> None:
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    job = await corpus(pool, ingestion, theirs, "kb1")
    async with tenant_transaction(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
        relabelled = await conn.fetch(
            "SELECT * FROM relabel_ingestion($1, $2, '{\"forged\": true}')", theirs, uuid.UUID(job.id)
        )
        assert relabelled == []
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with tenant_transaction(pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
            await conn.fetch(
                "SELECT * FROM queue_ingestion($1, 'kb1', 'doc', $2, gen_random_uuid(), 9, 'text/plain', "
                "'\\x00', 1, NULL, 'forged')",
                theirs,
                uuid.UUID(job.id),
            )
    assert await ingestion.get(job) == job


async def test_the_runners_functions_work_only_under_the_ingestions_namespace(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, database_pools: tuple[asyncpg.Pool, asyncpg.Pool]
) -> None:
    """Declared for another namespace, a leased ingestion's bytes and staged chunks read as
    nothing: row-level security holds the owner's functions to the declared tenant too."""
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    job = await corpus(pool, ingestion, theirs, "kb1")
    runner_pool = database_pools[1]
    async with tenant_transaction(runner_pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
        arguments = (theirs, uuid.UUID(job.id), RUNNER)
        assert await conn.fetchval("SELECT ingestion_bytes($1, $2, $3)", *arguments) is None
        assert await conn.fetch("SELECT * FROM ingestion_unembedded($1, $2, $3, 10)", *arguments) == []
    # Declared right, the lease holder reads them.
    assert await ingestion.content(job, RUNNER) == b"next version"
    assert len(await ingestion.unembedded(job, RUNNER, limit=10) or []) == 2


async def test_the_text_index_function_reads_only_the_declared_tenants_bases(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, database: SharedDatabase
) -> None:
    """`chunks_matching` runs as the owner, past the chunks' tenant policy (so the GIN index can
    answer a text search: migration 0028); it must check the declared tenant itself. Another
    namespace, a base outside the declared ones, or a declared base paired with another namespace
    read as nothing."""
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, theirs, "kb1")
    await corpus(pool, ingestion, theirs, "kb2")
    await corpus(pool, ingestion, ours, "kb1")
    read = "SELECT namespace, kb_ref, chunk_index FROM chunks_matching($1, $2, $3, 'text'::tsquery, 10)"
    everything = Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))
    async with tenant_transaction(pool, everything) as conn:
        assert await conn.fetch(read, theirs, ["kb1", "kb2"], [0, 0]) == []
        assert len(await conn.fetch(read, ours, ["kb1"], [0])) == 2
    async with tenant_transaction(pool, Tenant(theirs, knowledge_bases=("kb2",))) as conn:
        found = await conn.fetch(read, theirs, ["kb1", "kb2"], [0, 0])
        assert {(r["namespace"], r["kb_ref"]) for r in found} == {(theirs, "kb2")}
        assert await conn.fetch(read, ours, ["kb1"], [0]) == []
    # No declared tenant: a pooled connection's settings are empty after its transactions; a new
    # session has none at all, where the policy's predicate is NULL, not false. Nothing either way.
    async with pool.acquire() as conn:
        assert await conn.fetch(read, theirs, ["kb1", "kb2"], [0, 0]) == []
    async with connect_as(database.app_credential_dir, database.dsn) as fresh:
        assert await fresh.fetchval("SELECT tokensvc.kb_visible($1, 'kb1')", theirs) is None
        assert await fresh.fetch(read, theirs, ["kb1", "kb2"], [0, 0]) == []


async def test_the_owner_reads_chunks_through_the_text_index_where_the_serving_role_cannot(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, database: SharedDatabase
) -> None:
    """Why `chunks_matching` exists: under the serving role's policy the planner may not answer
    `@@` (not leakproof) from the GIN index chunks_text even when told to avoid every other plan;
    under the owner's (0028: `true` on reads) it does."""
    namespace = f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, namespace, "kb1")
    # The text condition alone, so no other index could serve it; every other plan made a last resort.
    statement = (
        "EXPLAIN (COSTS OFF) SELECT chunk_index FROM tokensvc.chunks WHERE content_tsv @@ 'text'::tsquery"
    )
    settings = "SET LOCAL enable_seqscan = off; SET LOCAL enable_indexscan = off"
    # On Citus the shard's plan is the worker's: these settings must reach it.
    async with pool.acquire() as probe:
        if is_distributed(probe):
            settings = f"SET LOCAL citus.propagate_set_commands = 'local'; {settings}"

    async def plan(conn: asyncpg.Connection) -> str:
        return "\n".join(row[0] for row in await conn.fetch(statement))

    async with tenant_transaction(pool, Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
        await conn.execute(settings)
        assert "chunks_text" not in await plan(conn)
    async with connect_as(database.owner_credential_dir, database.dsn) as owner, owner.transaction():
        await owner.execute(settings)
        assert "Index Cond: (content_tsv @@" in await plan(owner)
        assert "chunks_text" in await plan(owner)


async def test_the_runner_counts_text_statistics_only_of_its_declared_tenants_bases(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, database_pools: tuple[asyncpg.Pool, asyncpg.Pool]
) -> None:
    """`count_text_statistics` runs as the owner, who reads every tenant's chunks (0028): declared
    for another namespace it must answer as for a base it cannot see, whatever the size threshold
    (else returning false below another base's chunk count and failing at it would tell the count)."""
    ours, theirs = f"rls-{uuid.uuid4().hex[:8]}", f"rls-{uuid.uuid4().hex[:8]}"
    await corpus(pool, ingestion, theirs, "kb1")  # two chunks
    runner_pool = database_pools[1]
    count = "SELECT count_text_statistics($1, 'kb1', $2, 0.1, 1, 0.1)"
    for min_base in (0, 1, 2, 3):
        async with tenant_transaction(
            runner_pool, Tenant(ours, knowledge_bases=(ALL_KNOWLEDGE_BASES,))
        ) as conn:
            assert await conn.fetchval(count, theirs, min_base) is False
    # Declared right, it counts the base (two chunks reach a threshold of 1).
    async with tenant_transaction(runner_pool, Tenant(theirs, knowledge_bases=("kb1",))) as conn:
        assert await conn.fetchval(count, theirs, 1) is True


async def test_a_collation_cannot_stretch_the_text_index_functions_tenant_check(
    pool: asyncpg.Pool, ingestion: PostgresIngestionStore, database: SharedDatabase
) -> None:
    """The arguments of `chunks_matching` carry the caller's collation into its tenant check; a
    nondeterministic one that ignores punctuation makes `rls-1234` equal `rls1234`. Declared as
    the second, asking for the first's chunks with that collation must read nothing: each row is
    checked on its own columns. A server built without ICU has no nondeterministic collation at
    all (the embedded one): there the attack's first step is refused, which the test asserts."""
    suffix = uuid.uuid4().hex[:8]
    victim, attacker = f"rls-{suffix}", f"rls{suffix}"
    await corpus(pool, ingestion, victim, "kb1")
    collation = f"tokensvc.punctuation_blind_{suffix}"
    create = (
        f"CREATE COLLATION {collation} (provider = icu, locale = 'und-u-ka-shifted', deterministic = false)"
    )
    refused = None
    async with superuser(database) as admin:
        try:
            await admin.execute(create)
        except asyncpg.FeatureNotSupportedError as exc:
            refused = str(exc)
    if refused is not None:
        assert "ICU is not supported" in refused
        return
    try:
        async with tenant_transaction(pool, Tenant(attacker, knowledge_bases=(ALL_KNOWLEDGE_BASES,))) as conn:
            assert await conn.fetchval(f"SELECT $1::text = $2::text COLLATE {collation}", victim, attacker)
            stretched = await conn.fetch(
                f"SELECT chunk_index FROM chunks_matching($1 COLLATE {collation}, "  # noqa: S608
                f"ARRAY[$2 COLLATE {collation}], ARRAY[0], 'text'::tsquery, 10)",
                victim,
                "kb1",
            )
        assert stretched == []
    finally:
        async with superuser(database) as admin:
            await admin.execute(f"DROP COLLATION {collation}")
