"""Long-term memories in PostgreSQL + pgvector (the contract: `tokensvc.storage.ports.MemoryStore`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import asyncpg
import numpy as np
from pgvector import Vector

from tokensvc.errors import AlreadyExists
from tokensvc.storage.filter_language import Filter
from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.filter_sql import compile_filter
from tokensvc.storage.postgres.ranking import (
    Corpus,
    fetch_candidates,
    search_settings,
)
from tokensvc.storage.postgres.ranking import search_statement as ranking_statement
from tokensvc.storage.postgres.tenant import is_distributed, tenant_transaction
from tokensvc.storage.records import (
    CandidateQuery,
    EmbedderSpec,
    MemoryRecord,
    MemorySpace,
    NewMemory,
    SearchOutcome,
    SearchPlan,
    StoredRef,
    Tenant,
)

__all__ = [
    "PostgresMemoryStore",
    "ensure_vector_index",
    "memory_record",
    "search_statement",
]

_LIVE = "(expires_at IS NULL OR expires_at > now())"
_COLUMNS = "id, content, metadata, created_at, updated_at, expires_at"
# A memory's neighbours are the bucket's memories remembered just before and after it.
_CORPUS = Corpus(
    table="memories",
    partition=("bucket",),
    local="id",
    order=("created_at", "id"),
    columns=("id", "content", "metadata", "created_at", "updated_at", "expires_at"),
    key_types=("text", "uuid"),
)
# The vector slots (migration 0014): a space reads and writes the one of its generation.
_SLOTS = (_CORPUS, replace(_CORPUS, vector="embedding_b", dimension="dimension_b"))


def _slot(tenant: Tenant) -> Corpus:
    """The corpus of the slot `tenant.generation` uses (generation 0 when not declared)."""
    return _SLOTS[(tenant.generation or 0) % 2]


def memory_record(row: asyncpg.Record, embedder: str) -> MemoryRecord:
    """A memory row (the columns of `_COLUMNS`) as its record."""
    return MemoryRecord(
        id=str(row["id"]),
        content=row["content"],
        metadata=dict(row["metadata"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        expires_at=row["expires_at"],
        embedder=embedder,
    )


_SPACE_SQL = (
    "SELECT s.embedder, s.model, s.dimension, s.normalized, s.text_config::text, s.generation, "
    "m.to_embedder, m.to_model, m.to_dimension, m.to_normalized, m.id FROM memory_spaces s "
    "LEFT JOIN embedding_migrations m ON m.namespace = s.namespace AND m.agent = s.agent "
    "AND m.state = 'backfilling' WHERE s.namespace = $1 AND s.agent = $2"
)


def _space(row: asyncpg.Record) -> MemorySpace:
    target = None if row[6] is None else EmbedderSpec(row[6], row[7], row[8], row[9])
    return MemorySpace(
        EmbedderSpec(row[0], row[1], row[2], row[3]),
        row[4],
        row[5],
        migration_id=None if row[10] is None else str(row[10]),
        migrating_to=target,
    )


def _where(bucket_param: str, filter_: Filter | None, params: list[Any]) -> str:
    clause = f"bucket = {bucket_param} AND {_LIVE}"
    if filter_ is not None:
        clause += f" AND ({compile_filter(filter_, 'metadata', params)})"
    return clause


def search_statement(
    bucket: str, query: CandidateQuery, filter_: Filter | None, *, slot: int = 0
) -> tuple[str, list[Any], dict[str, str] | None]:
    """The statement, parameters and transaction settings a search of `bucket` runs (without the
    exact re-run of a short approximate scan): what EXPLAIN tests and the bench's same-SQL
    baseline use."""
    sql, params = ranking_statement(_SLOTS[slot], _bucket_predicate(bucket, filter_), query)
    return sql, params, search_settings(query)


def _bucket_predicate(bucket: str, filter_: Filter | None) -> Callable[[list[Any], bool], str]:
    def where(params: list[Any], searchable: bool) -> str:
        params.append(bucket)
        return _where("$1", filter_, params) if searchable else "bucket = $1"

    return where


async def ensure_vector_index(
    pool: asyncpg.Pool, dimension: int, slot: int, *, first_partition_only: bool = False
) -> None:
    """The HNSW indexes of (slot, dimension) on every partition, built one partition per
    statement (each its own transaction: a build holds up writes to one partition at a time),
    each on a connection taken from `pool` for that statement only: a build of minutes (Citus)
    never keeps a connection from the RPCs. `first_partition_only`: start the build (the parent
    index and partition 0's), an unfinished build the `vector-indexes` duty finishes
    (`PostgresVectorIndexes`)."""
    async with pool.acquire() as conn:
        if await conn.fetchval("SELECT memory_vector_index_ready($1, $2)", dimension, slot):
            return
    part, more = 0, True
    while more:
        async with pool.acquire() as conn:
            more = await conn.fetchval(
                "SELECT ensure_memory_partition_index($1, $2, $3)", dimension, slot, part
            )
        part += 1
        more = more and not first_partition_only


async def _copy_bucket(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, source: str, target: str
) -> int:
    """Move a bucket's rows into another on Citus, which never changes a row's distribution
    column: copies under the new bucket (on its shard), then the originals deleted.

    The rows are locked first and only those are copied and deleted: a row written to the source
    meanwhile (a replica still on the old pepper) stays there for the next move, never deleted
    uncopied, as the single-node UPDATE would leave it.
    """
    ids = [row[0] for row in await conn.fetch("SELECT id FROM memories WHERE bucket = $1 FOR UPDATE", source)]
    if not ids:
        return 0
    columns = await conn.fetchval(
        "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute"
        " WHERE attrelid = 'tokensvc.memories'::regclass AND attnum > 0 AND NOT attisdropped"
        " AND attgenerated = ''"
    )
    selected = ", ".join("$2" if column == "bucket" else column for column in str(columns).split(", "))
    # RETURNING: Citus then inserts on the target's shard with INSERT ... SELECT, not with a
    # COPY, which row-level security refuses.
    copied = await conn.fetch(
        f"INSERT INTO memories ({columns}) SELECT {selected} FROM memories"
        " WHERE bucket = $1 AND id = ANY($3::uuid[]) RETURNING id",
        source,
        target,
        ids,
    )
    await conn.execute("DELETE FROM memories WHERE bucket = $1 AND id = ANY($2::uuid[])", source, ids)
    return len(copied)


@translate_errors
class PostgresMemoryStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    # --- memory spaces ----------------------------------------------------------------------

    async def get_space(self, tenant: Tenant) -> MemorySpace | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            row = await conn.fetchrow(_SPACE_SQL, tenant.namespace, tenant.agent)
        return None if row is None else _space(row)

    async def pin_space(self, tenant: Tenant, space: MemorySpace) -> MemorySpace:
        """Pin `space` unless the space is already pinned; returns what is pinned."""
        spec = space.embedder
        async with tenant_transaction(self._pool, tenant) as conn:
            await conn.execute(
                "INSERT INTO memory_spaces (namespace, agent, embedder, model, dimension, normalized, "
                "text_config) VALUES ($1, $2, $3, $4, $5, $6, $7::regconfig) "
                "ON CONFLICT (namespace, agent) DO NOTHING",
                tenant.namespace,
                tenant.agent,
                spec.name,
                spec.model,
                spec.dimension,
                spec.normalized,
                space.text_config,
            )
            row = await conn.fetchrow(_SPACE_SQL, tenant.namespace, tenant.agent)
            assert row is not None
            pinned = _space(row)
        async with self._pool.acquire() as conn:
            distributed = is_distributed(conn)
        # On Citus each partition's build is 32 shards' on the workers (seconds each under load,
        # minutes for all 256): the write starts the build and the `vector-indexes` duty finishes
        # it. Until then a partition without its index is searched exactly (correct, slower).
        await ensure_vector_index(
            self._pool, pinned.embedder.dimension, pinned.slot, first_partition_only=distributed
        )
        return pinned

    async def ensure_vector_index(self, dimension: int, *, slot: int = 0) -> None:
        await ensure_vector_index(self._pool, dimension, slot)

    # --- writes -----------------------------------------------------------------------------

    async def move_buckets(self, tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        """Move rows from older-pepper buckets into `target`; duplicates of target rows are dropped."""
        moved = 0
        # One move into a bucket at a time (replicas re-bucket the same user concurrently): moving
        # a row changes its partition, and a concurrent UPDATE of a row moved to another partition
        # is a serialization failure even under READ COMMITTED. The second move finds nothing.
        async with tenant_transaction(self._pool, tenant, lock=f"memories-move/{target}") as conn:
            # Expired rows are dead already; left in place, an expired target row would make a live
            # source row with the same content look like a duplicate and be dropped.
            await conn.execute(
                "DELETE FROM memories WHERE bucket = ANY($1::text[]) AND expires_at <= now()",
                [target, *sources],
            )
            # One source at a time: two older buckets may hold the same content as each other. The
            # target is never its own source: every row would be its own duplicate and be deleted.
            for source in dict.fromkeys(s for s in sources if s != target):
                # Uncorrelated subqueries: on Citus the two buckets are on different shards, and
                # it plans each subquery on its own shard first.
                await conn.execute(
                    "DELETE FROM memories WHERE bucket = $1 AND ("
                    " content_sha256 IN (SELECT content_sha256 FROM memories WHERE bucket = $2)"
                    " OR idempotency_key IN (SELECT idempotency_key FROM memories WHERE bucket = $2))",
                    source,
                    target,
                )
                if is_distributed(conn):
                    moved += await _copy_bucket(conn, source, target)
                else:
                    result = await conn.execute(
                        "UPDATE memories SET bucket = $2 WHERE bucket = $1", source, target
                    )
                    moved += int(result.split()[-1])
        return moved

    async def find_existing(
        self, tenant: Tenant, bucket: str, hashes: Sequence[bytes], keys: Sequence[str]
    ) -> list[StoredRef]:
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT id, content_sha256, idempotency_key FROM memories WHERE bucket = $1 AND {_LIVE} "
                "AND (content_sha256 = ANY($2::bytea[]) OR idempotency_key = ANY($3::text[]))",
                bucket,
                list(hashes),
                list(keys),
            )
        return [StoredRef(str(r[0]), r[1], r[2], inserted=False) for r in rows]

    async def insert(self, tenant: Tenant, bucket: str, rows: Sequence[NewMemory]) -> list[StoredRef]:
        """One statement for the whole batch; conflicts resolve to the existing rows. Rows are
        indexed for text search with the space's pinned configuration, read in the statement
        (`english`, the column default, for a space not pinned yet: the domain always pins first)."""
        dimension = int(rows[0].embedding.shape[0])
        slot = _slot(tenant)
        # A backfilling migration's vectors go to the other slot (all rows have one, or none do).
        other = _SLOTS[1 - _SLOTS.index(slot)]
        nexts = [r.next_embedding for r in rows]
        both = all(v is not None for v in nexts)
        next_columns = f", {other.dimension}, {other.vector}" if both else ""
        next_values = ", $13, u.next_embedding" if both else ""
        next_input = ", $12::vector[]" if both else ""
        next_name = ", next_embedding" if both else ""
        async with tenant_transaction(self._pool, tenant) as conn:
            # Expired rows would block a re-insert of the same content: clear them first.
            await conn.execute(
                "DELETE FROM memories WHERE bucket = $1 AND expires_at <= now() "
                "AND (content_sha256 = ANY($2::bytea[]) OR idempotency_key = ANY($3::text[]))",
                bucket,
                [r.content_sha256 for r in rows],
                [r.idempotency_key for r in rows if r.idempotency_key],
            )
            inserted = await conn.fetch(
                f"""
                INSERT INTO memories (bucket, id, namespace, agent, content, content_sha256, metadata,
                                      idempotency_key, {slot.dimension}, {slot.vector}, expires_at, created_at,
                                      updated_at, text_config{next_columns})
                SELECT $1, u.id, $2, $3, u.content, u.sha, u.metadata, u.key, $4, u.embedding,
                       CASE WHEN u.ttl IS NULL THEN NULL ELSE t.at + make_interval(secs => u.ttl) END, t.at, t.at,
                       coalesce((SELECT s.text_config FROM memory_spaces s
                                 WHERE s.namespace = $2 AND s.agent = $3), 'english'::regconfig){next_values}
                FROM unnest($5::uuid[], $6::text[], $7::bytea[], $8::jsonb[], $9::text[], $10::vector[],
                            $11::int[]{next_input})
                     WITH ORDINALITY AS u(id, content, sha, metadata, key, embedding, ttl{next_name}, ord)
                -- One clock reading per row (the reference to u makes it per row, in batch order):
                -- created == updated on insert, later items are newer, and the TTL counts from it.
                -- Plus `ord` microseconds: two readings can fall in one microsecond (on Citus,
                -- which reads them on the coordinator in a tight loop, they did), and later items
                -- must be strictly newer.
                CROSS JOIN LATERAL (SELECT clock_timestamp() + make_interval(secs => u.ord / 1e6) AS at
                                    WHERE u.ord IS NOT NULL) t
                ON CONFLICT DO NOTHING
                RETURNING id, content_sha256, idempotency_key
                """,
                bucket,
                tenant.namespace,
                tenant.agent,
                dimension,
                [r.id for r in rows],
                [r.content for r in rows],
                [r.content_sha256 for r in rows],
                [r.metadata for r in rows],
                [r.idempotency_key for r in rows],
                # Wrapped so asyncpg does not read a list of ndarrays as a 2-D array.
                [Vector(r.embedding) for r in rows],
                [r.ttl_seconds for r in rows],
                *(
                    [[Vector(v) for v in nexts if v is not None], int(nexts[0].shape[0])]  # type: ignore[union-attr]
                    if both
                    else []
                ),
            )
            refs = [StoredRef(str(r[0]), r[1], r[2], inserted=True) for r in inserted]
            done = {ref.content_sha256 for ref in refs}
            missing = [r for r in rows if r.content_sha256 not in done]
            if missing:
                # Lost a race with a concurrent writer of the same content/key: report its row (not
                # the rows this statement just inserted, which are already reported as inserted).
                existing = await conn.fetch(
                    "SELECT id, content_sha256, idempotency_key FROM memories WHERE bucket = $1 "
                    "AND (content_sha256 = ANY($2::bytea[]) OR idempotency_key = ANY($3::text[])) "
                    "AND id <> ALL($4::uuid[])",
                    bucket,
                    [r.content_sha256 for r in missing],
                    [r.idempotency_key for r in missing if r.idempotency_key],
                    [ref.id for ref in refs],
                )
                refs += [StoredRef(str(r[0]), r[1], r[2], inserted=False) for r in existing]
                if {r.content_sha256 for r in missing} - {ref.content_sha256 for ref in refs}:
                    # An idempotency key taken meanwhile by other content: roll the whole batch back.
                    raise AlreadyExists("an idempotency key of this request is used for different content")
        return refs

    async def update(
        self,
        tenant: Tenant,
        bucket: str,
        memory_id: str,
        *,
        content: tuple[str, bytes, np.ndarray] | None,
        metadata: dict[str, Any] | None,
        ttl_seconds: int | None,
        embedder: str,
    ) -> MemoryRecord | None:
        sets = ["updated_at = statement_timestamp()"]
        params: list[Any] = [bucket, memory_id]
        clear = ""
        if content is not None:
            params += [content[0], content[1], content[2]]
            slot = _slot(tenant)
            sets += [
                f"content = ${len(params) - 2}",
                f"content_sha256 = ${len(params) - 1}",
                f"{slot.vector} = ${len(params)}",
                f"{slot.dimension} = {int(content[2].shape[0])}",
            ]
            # An expired row with the new content is dead, yet its unique (bucket, content_sha256)
            # entry would refuse the update: delete it first, in the same statement. The one-time
            # filter on `cleared` runs the DELETE before the UPDATE writes, and the unique check
            # ignores a row this transaction deleted.
            clear = (
                "WITH cleared AS (DELETE FROM memories WHERE bucket = $1 AND content_sha256 = "
                f"${len(params) - 1} AND expires_at <= now() RETURNING 1) "
            )
        if metadata is not None:
            params.append(metadata)
            sets.append(f"metadata = ${len(params)}")
        if ttl_seconds is not None:
            params.append(ttl_seconds)
            sets.append(f"expires_at = now() + make_interval(secs => ${len(params)})")
        try:
            async with tenant_transaction(self._pool, tenant) as conn:
                row = await conn.fetchrow(
                    f"{clear}UPDATE memories SET {', '.join(sets)} WHERE bucket = $1 AND id = $2 AND {_LIVE} "
                    f"{'AND (SELECT count(*) FROM cleared) >= 0 ' if clear else ''}RETURNING {_COLUMNS}",
                    *params,
                )
        except asyncpg.UniqueViolationError:
            # Only (bucket, content_sha256) can collide here: another memory has this content.
            raise AlreadyExists("another memory in this bucket has this content", field="content") from None
        return None if row is None else memory_record(row, embedder)

    async def delete(self, tenant: Tenant, bucket: str, ids: Sequence[str]) -> int:
        async with tenant_transaction(self._pool, tenant) as conn:
            result = await conn.execute(
                f"DELETE FROM memories WHERE bucket = $1 AND id = ANY($2::uuid[]) AND {_LIVE}",
                bucket,
                list(ids),
            )
        return int(result.split()[-1])

    async def delete_all(self, tenant: Tenant, bucket: str) -> int:
        """Everything in the bucket, in one transaction; expired rows go too but are not counted."""
        async with tenant_transaction(self._pool, tenant) as conn:
            live = await conn.fetchval(
                f"WITH gone AS (DELETE FROM memories WHERE bucket = $1 RETURNING expires_at) "
                f"SELECT count(*) FROM gone WHERE {_LIVE}",
                bucket,
            )
        return int(live)

    async def sweep_expired(self, limit: int = 1000) -> int:
        """Delete up to `limit` expired rows of any bucket, through the owner's sweep function.

        The serving role itself can neither see nor delete another tenant's rows, expired or not.
        """
        async with self._pool.acquire() as conn:
            deleted = await conn.fetchval("SELECT sweep_expired_memories($1)", limit)
        return int(deleted)

    # --- reads ------------------------------------------------------------------------------

    async def get(self, tenant: Tenant, bucket: str, memory_id: str, embedder: str) -> MemoryRecord | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            row = await conn.fetchrow(
                f"SELECT {_COLUMNS} FROM memories WHERE bucket = $1 AND id = $2 AND {_LIVE}",
                bucket,
                memory_id,
            )
        return None if row is None else memory_record(row, embedder)

    async def list_page(
        self,
        tenant: Tenant,
        bucket: str,
        *,
        limit: int,
        after: tuple[datetime, str] | None,
        filter_: Filter | None,
        embedder: str,
    ) -> list[MemoryRecord]:
        params: list[Any] = [bucket]
        where = _where("$1", filter_, params)
        if after is not None:
            params += [after[0], after[1]]
            where += f" AND (created_at, id) < (${len(params) - 1}, ${len(params)}::uuid)"
        params.append(limit)
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS} FROM memories WHERE {where} "
                f"ORDER BY created_at DESC, id DESC LIMIT ${len(params)}",
                *params,
            )
        return [memory_record(row, embedder) for row in rows]

    async def search(
        self,
        tenant: Tenant,
        bucket: str,
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        count_cap: int,
        filter_: Filter | None,
        embedder: str,
    ) -> SearchOutcome[MemoryRecord]:
        rows, found = await fetch_candidates(
            self._pool,
            tenant,
            _slot(tenant),
            plan,
            _bucket_predicate(bucket, filter_),
            lambda row: memory_record(row, embedder),
            str,
            row_count=row_count,
            count_cap=count_cap,
        )
        return SearchOutcome(rows, found)
