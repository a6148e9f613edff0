"""Re-embedding migrations in PostgreSQL (the contract: `tokensvc.storage.ports.EmbeddingMigrationStore`).

The migration row (`embedding_migrations`, migration 0014) is the durable state. The runner
reaches every bucket of the one space it migrates through the owner's functions of 0014
(`migration_pending`, `migration_store`, `migration_clear`), each bound to one migration whose
lease the caller holds, never through a policy of the serving role.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import numpy as np
from pgvector import Vector

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.knowledge import chunk_columns
from tokensvc.storage.postgres.memories import ensure_vector_index
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import (
    ChunkingSpec,
    ChunkRow,
    EmbedderSpec,
    EmbeddingMigration,
    MigrationState,
    PendingDocument,
    PendingMemory,
    StoredChunk,
    Tenant,
)

__all__ = ["PostgresEmbeddingMigrationStore"]

_RUNNABLE = [MigrationState.BACKFILLING.value, MigrationState.RETIRING.value, MigrationState.CANCELLING.value]
_FINISHED = [MigrationState.SUCCEEDED.value, MigrationState.CANCELLED.value]
# The runner's lease, checked (and renewed) in the transaction that does the work.
# Times are statement_timestamp(), not clock_timestamp(): the same within one statement, and Citus
# refuses a volatile function in an UPDATE of a distributed or reference table.
_LEASED = "id = $1 AND lease_owner = $2 AND lease_until >= statement_timestamp()"


def _migration(row: asyncpg.Record) -> EmbeddingMigration:
    cursor = None if row["cursor_bucket"] is None else (row["cursor_bucket"], str(row["cursor_id"]))
    return EmbeddingMigration(
        id=str(row["id"]),
        namespace=row["namespace"],
        agent=row["agent"],
        from_generation=row["from_generation"],
        # The source's normalisation is not kept: every stored vector is unit length anyway.
        source=EmbedderSpec(row["from_embedder"], row["from_model"], row["from_dimension"], True),
        target=EmbedderSpec(row["to_embedder"], row["to_model"], row["to_dimension"], row["to_normalized"]),
        state=MigrationState(row["state"]),
        created_by=row["created_by"],
        reason=row["reason"],
        rows_total=row["rows_total"],
        rows_done=row["rows_done"],
        failures=row["failures"],
        lease_owner=row["lease_owner"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        cut_over_at=row["cut_over_at"],
        finished_at=row["finished_at"],
        cursor=cursor,
        kb_ref=row["kb_ref"],
        source_chunking=_chunking(row, "from"),
        target_chunking=_chunking(row, "to"),
        document_cursor=row["cursor_document"],
    )


def _chunking(row: asyncpg.Record, side: str) -> ChunkingSpec | None:
    if row[f"{side}_chunking"] is None:
        return None
    return ChunkingSpec(row[f"{side}_chunking"], row[f"{side}_chunk_size"], row[f"{side}_chunk_overlap"])


def _space(migration: EmbeddingMigration) -> Tenant:
    """The space's own rows of memory_spaces (its pin), no bucket."""
    return Tenant(migration.namespace, migration.agent or "")


def _subject(namespace: str, agent: str | None, kb_ref: str | None) -> Tenant:
    """The tenant a runner's transaction declares: the migrated space or knowledge base. The
    runner's functions set it too, but only on the coordinator; on Citus the workers' row-level
    security sees what the service declares."""
    if kb_ref is None:
        return Tenant(namespace, agent or "")
    return Tenant(namespace, knowledge_bases=(kb_ref,))


def _of(migration: EmbeddingMigration) -> Tenant:
    return _subject(migration.namespace, migration.agent, migration.kb_ref)


# Raised by tokensvc.leased_migration (0014): the runner does not hold the migration's lease.
_NOT_LEASED = "TK002"


async def _hold(conn: asyncpg.Connection, migration_id: str, runner: str) -> bool:
    """In a batch's transaction: the subject row FOR SHARE, then the migration row FOR UPDATE
    (0015's lock order), when `runner` holds the BACKFILLING migration's lease. The owner takes
    both, as it takes every lock and write of the batch (0018): on Citus two roles' locks on one
    row in one transaction are two worker backends waiting on each other."""
    return bool(await conn.fetchval("SELECT hold_migration($1, $2)", migration_id, runner))


async def _progress(
    conn: asyncpg.Connection,
    migration: EmbeddingMigration,
    runner: str,
    written: int,
    *,
    cursor: tuple[str, str] | None = None,
    document: str | None = None,
    lease_seconds: float,
) -> EmbeddingMigration | None:
    """Record a held batch's progress (migration_progress, 0018); None when the lease is gone."""
    row = await conn.fetchrow(
        "SELECT * FROM migration_progress($1, $2, $3, $4, $5::uuid, $6, $7)",
        migration.id,
        runner,
        written,
        None if cursor is None else cursor[0],
        None if cursor is None else cursor[1],
        document,
        lease_seconds,
    )
    return None if row is None else _migration(row)


def _cursor(migration: EmbeddingMigration) -> tuple[str | None, str | None]:
    return (None, None) if migration.cursor is None else migration.cursor


@translate_errors
class PostgresEmbeddingMigrationStore:
    def __init__(self, pool: asyncpg.Pool, *, distributed: bool = False):
        self._pool = pool
        self._distributed = distributed

    async def create(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        if migration.kb_ref is not None:
            return await self._create_for_base(migration)
        # On Citus the duty `vector-indexes` builds the rest, as for a new space's first write.
        await ensure_vector_index(
            self._pool,
            migration.target.dimension,
            migration.target_slot,
            first_partition_only=self._distributed,
        )
        source, target = migration.source, migration.target
        async with tenant_transaction(self._pool, _space(migration)) as conn:
            row = await conn.fetchrow(
                "INSERT INTO embedding_migrations (id, namespace, agent, from_generation, from_embedder, "
                "from_model, from_dimension, to_embedder, to_model, to_dimension, to_normalized, state, "
                "rows_total, created_by) "
                "SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'backfilling', $12, $13 "
                "WHERE EXISTS (SELECT 1 FROM memory_spaces WHERE namespace = $2 AND agent = $3 "
                "AND generation = $4) "
                "ON CONFLICT DO NOTHING RETURNING *",
                migration.id,
                migration.namespace,
                migration.agent,
                migration.from_generation,
                source.name,
                source.model,
                source.dimension,
                target.name,
                target.model,
                target.dimension,
                target.normalized,
                migration.rows_total,
                migration.created_by,
            )
        return None if row is None else _migration(row)

    async def _create_for_base(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        assert migration.kb_ref is not None
        assert migration.source_chunking is not None
        assert migration.target_chunking is not None
        async with self._pool.acquire() as conn:
            await conn.execute("SELECT ensure_chunk_vector_index($1)", migration.target.dimension)
        source, target = migration.source, migration.target
        before, after = migration.source_chunking, migration.target_chunking
        base = Tenant(migration.namespace, knowledge_bases=(migration.kb_ref,))
        async with tenant_transaction(self._pool, base) as conn:
            # The base row FOR SHARE: no cutover or deletion races the check of its generation.
            # Each read is a statement of its own: Citus cannot read a distributed table inside
            # an INSERT into a reference table.
            generation = await conn.fetchval(
                "SELECT knowledge_base_generation($1, $2)", migration.namespace, migration.kb_ref
            )
            if generation != migration.from_generation:
                return None
            documents = await conn.fetchval(
                "SELECT count(*) FROM documents WHERE namespace = $1 AND kb_ref = $2",
                migration.namespace,
                migration.kb_ref,
            )
            row = await conn.fetchrow(
                "INSERT INTO embedding_migrations (id, namespace, kb_ref, from_generation, from_embedder, "
                "from_model, from_dimension, to_embedder, to_model, to_dimension, to_normalized, "
                "from_chunking, from_chunk_size, from_chunk_overlap, to_chunking, to_chunk_size, "
                "to_chunk_overlap, state, rows_total, created_by) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, "
                "'backfilling', $18, $19) "
                "ON CONFLICT DO NOTHING RETURNING *",
                migration.id,
                migration.namespace,
                migration.kb_ref,
                migration.from_generation,
                source.name,
                source.model,
                source.dimension,
                target.name,
                target.model,
                target.dimension,
                target.normalized,
                before.kind,
                before.size,
                before.overlap,
                after.kind,
                after.size,
                after.overlap,
                documents,
                migration.created_by,
            )
            if row is not None:
                # No document of the base has the new generation's chunks yet.
                await conn.execute(
                    "UPDATE documents SET migrated_version = NULL, migrated_chunk_count = NULL "
                    "WHERE namespace = $1 AND kb_ref = $2 AND migrated_version IS NOT NULL",
                    migration.namespace,
                    migration.kb_ref,
                )
        return None if row is None else _migration(row)

    async def get(self, migration_id: str) -> EmbeddingMigration | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM embedding_migrations WHERE id = $1", migration_id)
        return None if row is None else _migration(row)

    async def page(self, *, limit: int, before: tuple[datetime, str] | None) -> list[EmbeddingMigration]:
        params: list[Any] = [limit]
        where = ""
        if before is not None:
            params += [before[0], before[1]]
            where = "WHERE (created_at, id) < ($2, $3::uuid) "
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT * FROM embedding_migrations {where}ORDER BY created_at DESC, id DESC LIMIT $1",
                *params,
            )
        return [_migration(row) for row in rows]

    async def active(self) -> list[EmbeddingMigration]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM embedding_migrations WHERE state <> ALL($1::text[]) ORDER BY created_at, id",
                _FINISHED,
            )
        return [_migration(row) for row in rows]

    async def transition(
        self, migration_id: str, *, expect: Sequence[MigrationState], state: MigrationState, reason: str = ""
    ) -> EmbeddingMigration | None:
        async with self._pool.acquire() as conn:
            subject = await conn.fetchrow(
                "SELECT namespace, agent, kb_ref FROM embedding_migrations WHERE id = $1", migration_id
            )
        if subject is None:
            return None
        async with tenant_transaction(self._pool, _subject(*subject)) as conn:
            # The subject row first (0015's lock order): a cancel is ordered with every write of it.
            await conn.execute("SELECT lock_migration_subject($1, true)", migration_id)
            row = await conn.fetchrow(
                "UPDATE embedding_migrations SET state = $2, reason = $3, failures = 0, lease_owner = NULL, "
                "lease_until = NULL, updated_at = statement_timestamp(), "
                # Not a CASE: Citus refuses a non-immutable function inside one.
                f"finished_at = {'statement_timestamp()' if state.value in _FINISHED else 'NULL'}, "
                # The clean-up of a cancelled migration walks the space from the start.
                "cursor_bucket = CASE WHEN $2 = 'cancelling' THEN NULL ELSE cursor_bucket END, "
                "cursor_id = CASE WHEN $2 = 'cancelling' THEN NULL ELSE cursor_id END, "
                "cursor_document = CASE WHEN $2 = 'cancelling' THEN NULL ELSE cursor_document END "
                "WHERE id = $1 AND state = ANY($4::text[]) RETURNING *",
                migration_id,
                state.value,
                reason,
                [s.value for s in expect],
            )
        return None if row is None else _migration(row)

    async def claim(
        self,
        runner: str,
        *,
        lease_seconds: float,
        embedders: Sequence[str],
        retire_after_seconds: float,
        busy: Collection[str] = (),
    ) -> EmbeddingMigration | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                "UPDATE embedding_migrations SET lease_owner = $1, updated_at = statement_timestamp(), "
                "lease_until = statement_timestamp() + make_interval(secs => $2) "
                "WHERE id = (SELECT id FROM embedding_migrations WHERE state = ANY($4::text[]) "
                "AND (state <> 'backfilling' OR to_embedder = ANY($3::text[])) "
                "AND (state <> 'retiring' OR cut_over_at + make_interval(secs => $5) <= statement_timestamp()) "
                "AND (lease_owner IS NULL OR lease_owner = $1 OR lease_until < statement_timestamp()) "
                "AND id <> ALL($6::uuid[]) "
                "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING *",
                runner,
                lease_seconds,
                list(embedders),
                _RUNNABLE,
                retire_after_seconds,
                list(busy),
            )
        return None if row is None else _migration(row)

    async def pending(self, migration: EmbeddingMigration, *, limit: int) -> list[PendingMemory]:
        try:
            async with tenant_transaction(self._pool, _of(migration)) as conn:
                rows = await conn.fetch(
                    "SELECT * FROM migration_pending($1, $2, $3, $4::uuid, $5)",
                    migration.id,
                    migration.lease_owner,
                    *_cursor(migration),
                    limit,
                )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _NOT_LEASED:
                return []  # the lease is gone: the runner finds out at its next step
            raise
        return [PendingMemory(row[0], str(row[1]), row[2], row[3]) for row in rows]

    async def space_size(self, namespace: str, agent: str) -> tuple[int, int]:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM migration_space_size($1, $2)", namespace, agent)
        assert row is not None
        return int(row[0]), int(row[1])

    async def store_vectors(
        self,
        migration: EmbeddingMigration,
        runner: str,
        rows: Sequence[tuple[PendingMemory, np.ndarray]],
        *,
        lease_seconds: float,
    ) -> EmbeddingMigration | None:
        last = rows[-1][0] if rows else None
        async with tenant_transaction(self._pool, _of(migration)) as conn:
            if not await _hold(conn, migration.id, runner):
                return None
            written = await conn.fetchval(
                "SELECT migration_store($1, $2, $3::text[], $4::uuid[], $5::bytea[], $6::vector[])",
                migration.id,
                runner,
                [pending.bucket for pending, _ in rows],
                [pending.id for pending, _ in rows],
                [pending.content_sha256 for pending, _ in rows],
                [Vector(v) for _, v in rows],
            )
            return await _progress(
                conn,
                migration,
                runner,
                written,
                cursor=None if last is None else (last.bucket, last.id),
                lease_seconds=lease_seconds,
            )

    async def renew(self, migration: EmbeddingMigration, runner: str, *, lease_seconds: float) -> bool:
        async with self._pool.acquire() as conn:
            result = await conn.execute(
                "UPDATE embedding_migrations SET lease_until = statement_timestamp() + make_interval(secs => $3) "
                "WHERE id = $1 AND lease_owner = $2 AND state = ANY($4::text[])",
                migration.id,
                runner,
                lease_seconds,
                _RUNNABLE,
            )
        return result != "UPDATE 0"

    async def rewind(self, migration: EmbeddingMigration, runner: str) -> bool:
        async with self._pool.acquire() as conn:
            result = await conn.execute(
                "UPDATE embedding_migrations SET cursor_bucket = NULL, cursor_id = NULL, cursor_document = NULL, "
                f"updated_at = statement_timestamp() WHERE {_LEASED}",
                migration.id,
                runner,
            )
        return result != "UPDATE 0"

    async def cut_over(self, migration: EmbeddingMigration, runner: str) -> bool:
        function = "cut_over_memory_space" if migration.kb_ref is None else "cut_over_knowledge_base"
        async with tenant_transaction(self._pool, _of(migration)) as conn:
            done = await conn.fetchval(f"SELECT {function}($1, $2)", migration.id, runner)
        return bool(done)

    async def clear_slot(
        self, migration: EmbeddingMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        try:
            async with tenant_transaction(self._pool, _of(migration)) as conn:
                if migration.kb_ref is None:
                    # Locks the space row and the migration row itself, after its batch (0020).
                    function = "migration_clear"
                else:
                    await conn.execute("SELECT lock_migration_subject($1, false)", migration.id)  # lock order
                    function = "kb_migration_clear"
                cleared = await conn.fetchval(
                    f"SELECT {function}($1, $2, $3, $4)", migration.id, runner, limit, lease_seconds
                )
                row = await conn.fetchrow("SELECT * FROM embedding_migrations WHERE id = $1", migration.id)
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _NOT_LEASED:
                return None
            raise
        assert row is not None
        return int(cleared), _migration(row)

    async def pending_documents(self, migration: EmbeddingMigration, *, limit: int) -> list[PendingDocument]:
        try:
            async with tenant_transaction(self._pool, _of(migration)) as conn:
                documents = await conn.fetch(
                    "SELECT * FROM kb_migration_pending($1, $2, $3, $4)",
                    migration.id,
                    migration.lease_owner,
                    migration.document_cursor,
                    limit,
                )
                chunks: dict[str, list[StoredChunk]] = {}
                if documents and not migration.rechunks:
                    for row in await conn.fetch(
                        "SELECT * FROM kb_migration_chunks($1, $2, $3::text[], $4::bigint[])",
                        migration.id,
                        migration.lease_owner,
                        [d["ref"] for d in documents],
                        [d["version"] for d in documents],
                    ):
                        chunks.setdefault(row["doc_ref"], []).append(
                            StoredChunk(
                                row["chunk_index"],
                                row["text"],
                                row["start_offset"],
                                row["end_offset"],
                                tuple(row["heading_path"]),
                            )
                        )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _NOT_LEASED:
                return []
            raise
        return [
            PendingDocument(
                d["ref"], d["version"], d["content_sha256"], d["text"], tuple(chunks.get(d["ref"], ()))
            )
            for d in documents
        ]

    async def store_documents(
        self,
        migration: EmbeddingMigration,
        runner: str,
        documents: Sequence[tuple[PendingDocument, Sequence[ChunkRow]]],
        *,
        lease_seconds: float,
    ) -> EmbeddingMigration | None:
        positions = [position for position, (_, chunks) in enumerate(documents, 1) for _ in chunks]
        chunks = [chunk for _, rows in documents for chunk in rows]
        async with tenant_transaction(self._pool, _of(migration)) as conn:
            if not await _hold(conn, migration.id, runner):
                return None
            written = await conn.fetchval(
                "SELECT kb_migration_store($1, $2, $3::text[], $4::bigint[], $5::bytea[], $6::int[], "
                "$7::int[], $8::text[], $9::int[], $10::int[], $11::text[], $12::vector[])",
                migration.id,
                runner,
                [document.ref for document, _ in documents],
                [document.version for document, _ in documents],
                [document.content_sha256 for document, _ in documents],
                positions,
                *chunk_columns(chunks),
            )
            return await _progress(
                conn,
                migration,
                runner,
                written,
                document=documents[-1][0].ref if documents else None,
                lease_seconds=lease_seconds,
            )

    async def base_size(self, namespace: str, kb_ref: str) -> tuple[int, int, int, int]:
        async with tenant_transaction(self._pool, Tenant(namespace, knowledge_bases=(kb_ref,))) as conn:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM documents WHERE namespace = $1 AND kb_ref = $2), "
                "count(*), coalesce(avg(length(c.text)), 0)::integer, "
                "(SELECT count(*) FROM documents WHERE namespace = $1 AND kb_ref = $2 AND text IS NULL) "
                "FROM chunks c JOIN knowledge_bases b ON b.namespace = c.namespace AND b.ref = c.kb_ref "
                "AND b.generation = c.generation WHERE c.namespace = $1 AND c.kb_ref = $2",
                namespace,
                kb_ref,
            )
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    async def record_failure(
        self, migration: EmbeddingMigration, runner: str, reason: str, *, pause_after: int
    ) -> EmbeddingMigration | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                "UPDATE embedding_migrations SET failures = failures + 1, reason = $3, "
                "updated_at = statement_timestamp(), "
                "state = CASE WHEN failures + 1 >= $4 THEN 'paused' ELSE state END, "
                "lease_owner = CASE WHEN failures + 1 >= $4 THEN NULL ELSE lease_owner END, "
                "lease_until = CASE WHEN failures + 1 >= $4 THEN NULL ELSE lease_until END "
                f"WHERE {_LEASED} RETURNING *",
                migration.id,
                runner,
                reason,
                pause_after,
            )
        return None if row is None else _migration(row)
