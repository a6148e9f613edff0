"""Long-term memory storage: the contract and its PostgreSQL + pgvector implementation.

Contract (checked by tests/storage/test_memory_store.py):
- Every method is scoped to one tenant (namespace, agent) and one bucket; nothing outside that
  bucket is ever read, changed or counted (and row-level security enforces it a second time).
- `insert` is all-or-nothing; a row whose normalised content or idempotency key already exists in
  the bucket is not inserted and the existing row's id is reported (`inserted=False`); when an
  idempotency key already belongs to a row with other content, nothing is inserted and
  `AlreadyExists` is raised.
- `update` raises `AlreadyExists` (field `content`) when the new content is another row's.
- Expired rows are never returned, counted or updated.
- `search_vector(exact=True)` returns the true top-k by inner product among rows matching the
  filter; `exact=False` uses the HNSW index with iterative scans and returns min(k, matching)
  rows, ordered by score (re-running exactly, in the same transaction, when the approximate scan
  comes back short).
- `list_page` returns newest first (created_at, then id, descending), strictly after the cursor.
- Storage trusts its input: validation happened in the domain.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import numpy as np
from opentelemetry import trace
from pgvector import Vector

from tokensvc.embedders import EmbedderSpec
from tokensvc.errors import AlreadyExists
from tokensvc.memory.filters import Filter, compile_filter
from tokensvc.memory.models import MemoryRecord, NewMemory, ScoredMemory, StoredRef
from tokensvc.storage.tenant import Tenant, tenant_transaction

__all__ = ["PostgresMemoryStore"]

_LIVE = "(expires_at IS NULL OR expires_at > now())"
_COLUMNS = "id, content, metadata, created_at, updated_at, expires_at"


def _record(row: asyncpg.Record, embedder: str) -> MemoryRecord:
    return MemoryRecord(
        id=str(row["id"]),
        content=row["content"],
        metadata=dict(row["metadata"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        expires_at=row["expires_at"],
        embedder=embedder,
    )


def _where(bucket_param: str, filter_: Filter | None, params: list[Any]) -> str:
    clause = f"bucket = {bucket_param} AND {_LIVE}"
    if filter_ is not None:
        clause += f" AND ({compile_filter(filter_, 'metadata', params)})"
    return clause


def _vector_search_sql(
    bucket: str, query: np.ndarray, *, k: int, filter_: Filter | None, exact: bool
) -> tuple[str, list[Any]]:
    """The statement `search_vector` runs, and its parameters (tests EXPLAIN exactly this)."""
    dimension = int(query.shape[0])
    params: list[Any] = [bucket, query]
    where = _where("$1", filter_, params)
    params.append(k)
    if exact:
        return (
            f"SELECT {_COLUMNS}, -(embedding <#> $2) AS score FROM memories WHERE {where} "
            f"ORDER BY embedding <#> $2 LIMIT ${len(params)}"
        ), params
    # The typed expression and `dimension = N` match the partial index memories_hnsw_N.
    typed = f"embedding::vector({dimension})"
    return (
        f"SELECT * FROM (SELECT {_COLUMNS}, -({typed} <#> $2::vector({dimension})) AS score "
        f"FROM memories WHERE dimension = {dimension} AND {where} "
        f"ORDER BY {typed} <#> $2::vector({dimension}) LIMIT ${len(params)}) s "
        "ORDER BY score DESC"  # relaxed_order iterative scans may return slightly out of order
    ), params


def _hnsw_settings(*, ef_search: int, max_scan_tuples: int) -> dict[str, str]:
    """Transaction-local settings of an approximate search (set with the tenant, one round trip).

    pgvector 0.8's iterative scan, so a filtered search finds k rows, bounded by
    `max_scan_tuples`; and `enable_sort = off`, so the planner takes the HNSW index the caller
    chose by bucket size: under row-level security its row estimate for a bucket multiplies the
    selectivities of the query's and the policy's bucket predicates (far too few rows), which makes
    "read the bucket and sort" look cheap when it is the slow plan. A sort stays possible (the
    exact statement still has one); it is only costed as a last resort.
    """
    return {
        "hnsw.iterative_scan": "relaxed_order",
        "hnsw.ef_search": str(ef_search),
        "hnsw.max_scan_tuples": str(max_scan_tuples),
        "enable_sort": "off",
    }


async def _use_iterative_hnsw_scan(conn: asyncpg.Connection, *, ef_search: int, max_scan_tuples: int) -> None:
    """pgvector 0.8 iterative scans for this transaction, so a filtered search finds k rows."""
    await conn.execute(
        "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), "
        "set_config('hnsw.ef_search', $1, true), set_config('hnsw.max_scan_tuples', $2, true)",
        str(ef_search),
        str(max_scan_tuples),
    )


class PostgresMemoryStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    # --- memory spaces ----------------------------------------------------------------------

    async def get_space(self, tenant: Tenant) -> EmbedderSpec | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            row = await conn.fetchrow(
                "SELECT embedder, model, dimension, normalized FROM memory_spaces "
                "WHERE namespace = $1 AND agent = $2",
                tenant.namespace,
                tenant.agent,
            )
        return None if row is None else EmbedderSpec(row[0], row[1], row[2], row[3])

    async def pin_space(self, tenant: Tenant, spec: EmbedderSpec) -> EmbedderSpec:
        """Pin `spec` unless the space is already pinned; returns what is pinned."""
        async with tenant_transaction(self._pool, tenant) as conn:
            await conn.execute(
                "INSERT INTO memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
                "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (namespace, agent) DO NOTHING",
                tenant.namespace,
                tenant.agent,
                spec.name,
                spec.model,
                spec.dimension,
                spec.normalized,
            )
            row = await conn.fetchrow(
                "SELECT embedder, model, dimension, normalized FROM memory_spaces "
                "WHERE namespace = $1 AND agent = $2",
                tenant.namespace,
                tenant.agent,
            )
            assert row is not None
            pinned = EmbedderSpec(row[0], row[1], row[2], row[3])
        await self.ensure_vector_index(pinned.dimension)
        return pinned

    async def ensure_vector_index(self, dimension: int) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute("SELECT ensure_memory_vector_index($1)", dimension)

    # --- writes -----------------------------------------------------------------------------

    async def move_buckets(self, tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        """Move rows from older-pepper buckets into `target`; duplicates of target rows are dropped."""
        moved = 0
        async with tenant_transaction(self._pool, tenant) as conn:
            # Expired rows are dead already; left in place, an expired target row would make a live
            # source row with the same content look like a duplicate and be dropped.
            await conn.execute(
                "DELETE FROM memories WHERE bucket = ANY($1::text[]) AND expires_at <= now()",
                [target, *sources],
            )
            # One source at a time: two older buckets may hold the same content as each other.
            for source in sources:
                await conn.execute(
                    "DELETE FROM memories m WHERE bucket = $1 AND EXISTS ("
                    " SELECT 1 FROM memories t WHERE t.bucket = $2 AND (t.content_sha256 = m.content_sha256"
                    " OR t.idempotency_key = m.idempotency_key))",
                    source,
                    target,
                )
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
        """One statement for the whole batch; conflicts resolve to the existing rows."""
        dimension = int(rows[0].embedding.shape[0])
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
                """
                INSERT INTO memories (bucket, id, namespace, agent, content, content_sha256, metadata,
                                      idempotency_key, dimension, embedding, expires_at, created_at, updated_at)
                SELECT $1, u.id, $2, $3, u.content, u.sha, u.metadata, u.key, $4, u.embedding,
                       CASE WHEN u.ttl IS NULL THEN NULL ELSE t.at + make_interval(secs => u.ttl) END, t.at, t.at
                FROM unnest($5::uuid[], $6::text[], $7::bytea[], $8::jsonb[], $9::text[], $10::vector[],
                            $11::int[]) WITH ORDINALITY AS u(id, content, sha, metadata, key, embedding, ttl, ord)
                -- One clock reading per row (the reference to u makes it per row, in batch order):
                -- created == updated on insert, later items are newer, and the TTL counts from it.
                CROSS JOIN LATERAL (SELECT clock_timestamp() AS at WHERE u.ord IS NOT NULL) t
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
        sets = ["updated_at = clock_timestamp()"]
        params: list[Any] = [bucket, memory_id]
        if content is not None:
            params += [content[0], content[1], content[2]]
            sets += [
                f"content = ${len(params) - 2}",
                f"content_sha256 = ${len(params) - 1}",
                f"embedding = ${len(params)}",
            ]
        if metadata is not None:
            params.append(metadata)
            sets.append(f"metadata = ${len(params)}")
        if ttl_seconds is not None:
            params.append(ttl_seconds)
            sets.append(f"expires_at = now() + make_interval(secs => ${len(params)})")
        try:
            async with tenant_transaction(self._pool, tenant) as conn:
                row = await conn.fetchrow(
                    f"UPDATE memories SET {', '.join(sets)} WHERE bucket = $1 AND id = $2 AND {_LIVE} "
                    f"RETURNING {_COLUMNS}",
                    *params,
                )
        except asyncpg.UniqueViolationError:
            # Only (bucket, content_sha256) can collide here: another memory has this content.
            raise AlreadyExists("another memory in this bucket has this content", field="content") from None
        return None if row is None else _record(row, embedder)

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
            live = await conn.fetchval(f"SELECT count(*) FROM memories WHERE bucket = $1 AND {_LIVE}", bucket)
            await conn.execute("DELETE FROM memories WHERE bucket = $1", bucket)
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
        return None if row is None else _record(row, embedder)

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
        return [_record(row, embedder) for row in rows]

    async def bucket_size(self, tenant: Tenant, bucket: str, cap: int) -> int:
        """Rows in the bucket, counted up to `cap` (enough to choose a search path cheaply)."""
        async with tenant_transaction(self._pool, tenant) as conn:
            value = await conn.fetchval(
                "SELECT count(*) FROM (SELECT 1 FROM memories WHERE bucket = $1 LIMIT $2) s", bucket, cap
            )
        return int(value)

    async def search_vector(
        self,
        tenant: Tenant,
        bucket: str,
        query: np.ndarray,
        *,
        k: int,
        filter_: Filter | None,
        exact: bool,
        ef_search: int,
        max_scan_tuples: int,
        embedder: str,
    ) -> list[ScoredMemory]:
        sql, params = _vector_search_sql(bucket, query, k=k, filter_=filter_, exact=exact)
        settings = None if exact else _hnsw_settings(ef_search=ef_search, max_scan_tuples=max_scan_tuples)
        async with tenant_transaction(self._pool, tenant, settings=settings) as conn:
            rows = await conn.fetch(sql, *params)
            if not exact and len(rows) < k:
                # The approximate scan gave up early (a selective filter in a big index): an exact
                # scan of the bucket, in the same transaction, keeps the search complete.
                trace.get_current_span().set_attribute("tokensvc.search.exact_fallback", True)
                sql, params = _vector_search_sql(bucket, query, k=k, filter_=filter_, exact=True)
                rows = await conn.fetch(sql, *params)
        return [ScoredMemory(_record(row, embedder), float(row["score"])) for row in rows]

    # Full-text ranking uses web-search syntax: every word must match unless the query says
    # `or`; "quoted phrases" and -exclusions work. The vector ranking covers loose paraphrases.
    async def search_text(
        self, tenant: Tenant, bucket: str, text: str, *, k: int, filter_: Filter | None, embedder: str
    ) -> list[ScoredMemory]:
        params: list[Any] = [bucket, text]
        where = _where("$1", filter_, params)
        params.append(k)
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS}, ts_rank_cd(content_tsv, q) AS score "
                f"FROM memories, websearch_to_tsquery('simple', $2) q "
                f"WHERE {where} AND content_tsv @@ q "
                f"ORDER BY score DESC, created_at DESC LIMIT ${len(params)}",
                *params,
            )
        return [ScoredMemory(_record(row, embedder), float(row["score"])) for row in rows]
