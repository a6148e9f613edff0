"""What only a Citus cluster shows: where `migrate` put each table, that the tenant's settings
reach the workers, that tenant statements are router queries to one shard, and that rows spread
over the workers stay apart."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import asyncpg
import pytest

from tests.storage.search_support import EmbeddedLater
from tests.storage.test_memory_rls import NAMESPACE, SEARCH_KINDS, new_bucket, open_pool, rows
from tests.support import service_settings, superuser
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.retrieval import candidate_query
from tokensvc.storage.postgres import PLACEMENTS, schema_migrations
from tokensvc.storage.postgres.memories import PostgresMemoryStore, search_statement
from tokensvc.storage.postgres.tenant import distributed_pool, tenant_transaction
from tokensvc.storage.records import Tenant

# Tables that stay plain tables of the coordinator.
COORDINATOR_TABLES = {
    "audit_events",
    "capability_revocations",
    "credential_rotations",
    "data_subject_receipts",
    "schema_functions",
    "schema_migrations",
}
# Each function's definition, by signature: compared between the coordinator and the workers.
FUNCTION_DEFINITIONS = (
    "SELECT coalesce(json_object_agg(p.oid::regprocedure::text, md5(pg_get_functiondef(p.oid))), '{}') "
    "FROM pg_proc p WHERE p.pronamespace = 'tokensvc'::regnamespace"
)


@pytest.fixture(scope="module")
async def pool(
    database: object, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    db, pool = await open_pool(database, dev, tmp_path_factory)  # type: ignore[arg-type]
    try:
        yield pool
    finally:
        await db.close()


async def test_migrate_distributes_the_tenant_tables_and_keeps_the_global_ones_on_the_coordinator(
    database: object,
) -> None:
    async with superuser(database) as conn:  # type: ignore[arg-type]
        placed = {
            row["name"]: row
            for row in await conn.fetch(
                "SELECT c.relname AS name, p.partmethod::text AS partmethod, p.colocationid, "
                "column_to_column_name(p.logicalrelid, p.partkey) AS column, "
                "(SELECT count(*) FROM pg_dist_shard s WHERE s.logicalrelid = p.logicalrelid) AS shards "
                "FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid "
                "WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relname NOT LIKE 'memories\\_p%'"
            )
        }
        tables = {
            row[0]
            for row in await conn.fetch(
                "SELECT relname FROM pg_class WHERE relnamespace = 'tokensvc'::regnamespace "
                "AND relkind IN ('r', 'p') AND NOT relispartition"
            )
        }
        partitions = await conn.fetchval(
            "SELECT count(*) FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid "
            "WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relname LIKE 'memories\\_p%' "
            "AND p.partmethod = 'h' AND p.colocationid = (SELECT colocationid FROM pg_dist_partition "
            "WHERE logicalrelid = 'tokensvc.memories'::regclass)"
        )
    expected = {p.table: p for p in PLACEMENTS}
    assert set(placed) == set(expected)
    for name, placement in expected.items():
        row = placed[name]
        if placement.column is None:
            assert row["partmethod"] == "n", name  # a reference table: a copy on every node
        else:
            assert (row["partmethod"], row["column"], row["shards"]) == ("h", placement.column, 32), name
    knowledge = {placed[t]["colocationid"] for t in ("knowledge_bases", "documents", "chunks")}
    assert len(knowledge) == 1
    # Every one of the 256 partitions is distributed alongside its parent, by the same bucket.
    assert partitions == 256
    assert tables - set(placed) == COORDINATOR_TABLES


async def test_a_second_migrate_changes_nothing(
    database: object, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> None:
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("again")))  # type: ignore[arg-type]
    assert await db.migrate("tokensvc_app") == []


async def test_changed_function_files_apply_on_a_placed_schema_and_reach_the_workers(
    database: object, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function file changed after the tables were placed is applied through the coordinator
    (CREATE OR REPLACE of functions and of triggers on distributed tables), and every worker
    holding a function ends with the coordinator's definition."""
    shipped = schema_migrations.available_schema_functions()
    changed = [replace(family, sql=family.sql + "\n-- changed\n") for family in shipped]
    monkeypatch.setattr(schema_migrations, "available_schema_functions", lambda: changed)
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("functions")))  # type: ignore[arg-type]
    try:
        assert await db.migrate("tokensvc_app") == [family.label for family in changed]
    finally:
        # Back to the shipped files, recorded again, for the tests that follow.
        monkeypatch.setattr(schema_migrations, "available_schema_functions", lambda: shipped)
        async with superuser(database) as conn:  # type: ignore[arg-type]
            await conn.execute("DELETE FROM tokensvc.schema_functions")
        await db.migrate("tokensvc_app")
    async with superuser(database) as conn:  # type: ignore[arg-type]
        # The workers' commands run on the default path: names print qualified on both sides.
        await conn.execute("SET search_path = public")
        coordinator = json.loads(await conn.fetchval(FUNCTION_DEFINITIONS))
        workers = [
            json.loads(row["result"])
            for row in await conn.fetch("SELECT result FROM run_command_on_workers($1)", FUNCTION_DEFINITIONS)
        ]
        triggers = await conn.fetchval(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'tokensvc.memories'::regclass AND NOT tgisinternal"
        )
    assert triggers == 1
    assert len(workers) == 2
    for worker in workers:
        # The trigger functions and the policies' predicate are on every worker, as on the coordinator.
        assert {"tokensvc.memories_generation_guard()", "tokensvc.kb_visible(text,text)"} <= set(worker)
        assert {name: worker[name] for name in worker} == {name: coordinator[name] for name in worker}


async def test_the_tenant_reaches_the_worker_holding_the_bucket_and_ends_with_the_transaction(
    pool: asyncpg.Pool,
) -> None:
    store = PostgresMemoryStore(pool)
    tenant = Tenant(NAMESPACE, f"agent-{uuid.uuid4().hex[:12]}", (new_bucket(),))
    await store.insert(tenant, tenant.buckets[0], rows(2, "mine"))
    # current_setting() runs on the worker: the statement is a router query the shard executes.
    probe = "SELECT DISTINCT current_setting('tokensvc.buckets', true) FROM memories WHERE bucket = $1"
    async with tenant_transaction(pool, tenant) as conn:
        assert await conn.fetchval(probe, tenant.buckets[0]) == tenant.buckets[0]
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN (VERBOSE) {probe}", tenant.buckets[0]))
        assert "Task Count: 1" in plan, plan
    # The same pooled connection, no tenant declared: the worker has no tenant left either.
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE bucket = $1", tenant.buckets[0]) == 0


@pytest.mark.parametrize(("text", "exact", "neighbours"), SEARCH_KINDS)
async def test_every_kind_of_search_is_a_router_query_to_one_shard(
    pool: asyncpg.Pool, text: str | None, exact: bool, neighbours: bool
) -> None:
    store = PostgresMemoryStore(pool)
    tenant = Tenant(NAMESPACE, f"agent-{uuid.uuid4().hex[:12]}", (new_bucket(),))
    await store.insert(tenant, tenant.buckets[0], rows(3, "memory"))
    query = candidate_query(
        vector=rows(1, "q")[0].embedding, text=text, k=5, rows=3, exact=exact, neighbours=neighbours
    )
    sql, params, settings = search_statement(tenant.buckets[0], query, None)
    async with tenant_transaction(pool, tenant, settings=settings) as conn:
        found = await conn.fetch(sql, *params)
        plan = json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params))
    assert found
    citus = plan[0]["Plan"]
    assert (citus["Node Type"], citus["Custom Plan Provider"]) == ("Custom Scan", "Citus Adaptive"), citus
    assert citus["Distributed Query"]["Job"]["Task Count"] == 1


async def test_a_knowledge_search_is_a_router_query_to_the_namespaces_shard(pool: asyncpg.Pool) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:12]}"
    tenant = Tenant(namespace, knowledge_bases=("kb",))
    async with tenant_transaction(pool, tenant) as conn:
        plan = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN SELECT c.chunk_index FROM chunks c JOIN documents d ON d.namespace = c.namespace "
                "AND d.kb_ref = c.kb_ref AND d.ref = c.doc_ref AND d.version = c.version "
                "JOIN knowledge_bases b ON b.namespace = c.namespace AND b.ref = c.kb_ref "
                "WHERE c.namespace = $1 AND c.kb_ref = ANY($2::text[]) LIMIT 5",
                namespace,
                ["kb"],
            )
        )
    assert "Task Count: 1" in plan, plan


async def test_users_spread_over_both_workers_and_each_sees_only_their_own(
    pool: asyncpg.Pool, database: object
) -> None:
    store = PostgresMemoryStore(pool)
    agent = f"agent-{uuid.uuid4().hex[:12]}"
    tenants = [Tenant(NAMESPACE, agent, (new_bucket(),)) for _ in range(16)]
    for index, tenant in enumerate(tenants):
        await store.insert(tenant, tenant.buckets[0], rows(2, f"user{index}"))
    async with superuser(database) as conn:  # type: ignore[arg-type]
        nodes = await conn.fetch(
            "SELECT DISTINCT n.nodeport FROM unnest($1::text[]) b(bucket) "
            "JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('tokensvc.memories', b.bucket) "
            "JOIN pg_dist_node n ON n.groupid = p.groupid",
            [t.buckets[0] for t in tenants],
        )
        workers = await conn.fetchval("SELECT count(*) FROM pg_dist_node WHERE groupid > 0 AND isactive")
    assert len(nodes) == workers >= 2
    # Each user, reading without a bucket predicate, gets exactly their own rows from their shard.
    for index, tenant in enumerate(tenants):
        async with tenant_transaction(pool, tenant) as conn:
            contents = [r[0] for r in await conn.fetch("SELECT content FROM memories")]  # no bucket predicate
        assert sorted(c.split()[0] for c in contents) == [f"user{index}"] * 2, contents


@pytest.mark.parametrize("exact", [True, False])
async def test_a_search_waits_for_its_query_before_its_transaction(pool: asyncpg.Pool, exact: bool) -> None:
    """On one node a HYBRID search ranks by text while its query embeds, in one snapshot; on Citus
    each statement reads each worker's own snapshot, so the search embeds first and holds no
    connection meanwhile (docs/scaling.md): a memory written during the wait is then seen."""
    assert distributed_pool(pool)
    store = PostgresMemoryStore(pool)
    tenant = Tenant(NAMESPACE, f"agent-{uuid.uuid4().hex[:12]}", (new_bucket(),))
    await store.insert(tenant, tenant.buckets[0], rows(6, "memory"))
    later = EmbeddedLater()
    query = candidate_query(
        vector=None, text="memory", k=5, rows=6, exact=exact, neighbours=True, vector_later=later
    )
    searching = asyncio.ensure_future(
        store.search(
            tenant,
            tenant.buckets[0],
            lambda _rows: query,
            row_count=6,
            count_cap=1,
            filter_=None,
            embedder="t",
        )
    )
    await asyncio.wait_for(later.awaited.wait(), 30)
    in_use = pool.get_size() - pool.get_idle_size()
    (newcomer,) = rows(1, "memory newcomer")
    await store.insert(tenant, tenant.buckets[0], [newcomer])
    later.vector.set_result(newcomer.embedding)
    found = (await searching).candidates

    assert in_use == 0
    assert newcomer.id in {c.item.id for c in found}
