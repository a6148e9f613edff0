"""Re-embedding migrations in PostgreSQL (the contract: `tokensvc.storage.ports.EmbeddingMigrationStore`).

The migration row (`embedding_migrations`, migration 0014) is the durable state. The runner
reaches every bucket of the one space it migrates through the owner's functions of 0014
(`migration_pending`, `migration_store`, `migration_clear`), each bound to one migration whose
lease the caller holds, never through a policy of the serving role.

Two pools, two roles (migration 0021): the operator's calls (create, status, cancel, resume, the
sizes) run on the serving pool, which may read migrations but write them only through functions
that check the input (`start_memory_migration`, `start_knowledge_migration`,
`change_migration_state`); the runner's calls (claim, lease, batches, clean-up, cutover, finish)
run on the runner's pool, whose role alone may execute the runner's functions. The serving role
never sees the backfill cursor (a bucket id).
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
from tokensvc.storage.postgres.locations import location_from, spans_from
from tokensvc.storage.postgres.memories import ensure_vector_index
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.postgres.text_statistics import TEXT_STATISTICS, TextStatisticsPolicy, recount
from tokensvc.storage.records import ChunkingSpec, ChunkRow, EmbedderSpec, StoredChunk, Tenant
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
    PendingDocument,
    PendingMemory,
)

__all__ = ["PostgresEmbeddingMigrationStore"]

_FINISHED = [MigrationState.SUCCEEDED.value, MigrationState.CANCELLED.value]


# The columns the serving role may read (0021): all but the backfill cursor.
_SERVED = (
    "id, namespace, agent, kb_ref, from_generation, from_embedder, from_model, from_dimension, "
    "to_embedder, to_model, to_dimension, to_normalized, from_chunking, from_chunk_size, "
    "from_chunk_overlap, to_chunking, to_chunk_size, to_chunk_overlap, state, reason, rows_total, "
    "rows_done, failures, lease_owner, lease_until, created_by, created_at, updated_at, cut_over_at, "
    "finished_at, cursor_document"
)
# The runner's transitions (finish_migration); the operator's are change_migration_state's.
_RUNNER_STATES = frozenset({MigrationState.SUCCEEDED, MigrationState.CANCELLED, MigrationState.PAUSED})


def _common(row: asyncpg.Record) -> dict[str, Any]:
    """The fields both kinds of migration have, from a migration row."""
    return {
        "id": str(row["id"]),
        "namespace": row["namespace"],
        "from_generation": row["from_generation"],
        # The source's normalisation is not kept: every stored vector is unit length anyway.
        "source": EmbedderSpec(row["from_embedder"], row["from_model"], row["from_dimension"], True),
        "target": EmbedderSpec(
            row["to_embedder"], row["to_model"], row["to_dimension"], row["to_normalized"]
        ),
        "state": MigrationState(row["state"]),
        "created_by": row["created_by"],
        "reason": row["reason"],
        "rows_total": row["rows_total"],
        "rows_done": row["rows_done"],
        "failures": row["failures"],
        "lease_owner": row["lease_owner"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "cut_over_at": row["cut_over_at"],
        "finished_at": row["finished_at"],
    }


def _space_migration(row: asyncpg.Record) -> MemorySpaceMigration:
    bucket = row.get("cursor_bucket")
    cursor = None if bucket is None else (bucket, str(row["cursor_id"]))
    return MemorySpaceMigration(**_common(row), agent=row["agent"], cursor=cursor)


def _base_migration(row: asyncpg.Record) -> KnowledgeBaseMigration:
    return KnowledgeBaseMigration(
        **_common(row),
        kb_ref=row["kb_ref"],
        source_chunking=_chunking(row, "from"),
        target_chunking=_chunking(row, "to"),
        document_cursor=row["cursor_document"],
    )


def _migration(row: asyncpg.Record) -> EmbeddingMigration:
    """The row as its kind's record: a knowledge base's when it names one, else a space's."""
    return _space_migration(row) if row["kb_ref"] is None else _base_migration(row)


def _chunking(row: asyncpg.Record, side: str) -> ChunkingSpec:
    return ChunkingSpec(row[f"{side}_chunking"], row[f"{side}_chunk_size"], row[f"{side}_chunk_overlap"])


def _subject(namespace: str, agent: str | None, kb_ref: str | None) -> Tenant:
    """The tenant a runner's transaction declares: the migrated space or knowledge base. The
    runner's functions set it too, but only on the coordinator; on Citus the workers' row-level
    security sees what the service declares."""
    if kb_ref is None:
        return Tenant(namespace, agent or "")
    return Tenant(namespace, knowledge_bases=(kb_ref,))


def _of(migration: EmbeddingMigration) -> Tenant:
    match migration:
        case MemorySpaceMigration():
            return Tenant(migration.namespace, migration.agent)
        case KnowledgeBaseMigration():
            return Tenant(migration.namespace, knowledge_bases=(migration.kb_ref,))


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
) -> asyncpg.Record | None:
    """Record a held batch's progress (migration_progress, 0018): the migration's row, None when
    the lease is gone."""
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
    return row


def _cursor(migration: MemorySpaceMigration) -> tuple[str | None, str | None]:
    return (None, None) if migration.cursor is None else migration.cursor


@translate_errors
class PostgresEmbeddingMigrationStore:
    """`pool`: the serving role's; `runner_pool`: the runner role's (the runner's calls fail
    without it, unless `pool` is itself a runner's)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        runner_pool: asyncpg.Pool | None = None,
        distributed: bool = False,
        statistics: TextStatisticsPolicy = TEXT_STATISTICS,
    ):
        self._pool = pool
        self._runner = runner_pool or pool
        self._distributed = distributed
        self._statistics = statistics

    async def create(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        match migration:
            case MemorySpaceMigration():
                return await self._create_for_space(migration)
            case KnowledgeBaseMigration():
                return await self._create_for_base(migration)

    async def _create_for_space(self, migration: MemorySpaceMigration) -> EmbeddingMigration | None:
        target = migration.target
        # The source is the space's pin as the database has it (the function reads it).
        async with tenant_transaction(self._pool, _of(migration)) as conn:
            row = await conn.fetchrow(
                "SELECT * FROM start_memory_migration($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                migration.id,
                migration.namespace,
                migration.agent,
                migration.from_generation,
                target.name,
                target.model,
                target.dimension,
                target.normalized,
                migration.rows_total,
                migration.created_by,
            )
        if row is None:
            return None
        # After the row (the build is refused for a dimension nothing uses), which no runner
        # claims until it is released. On Citus the duty `vector-indexes` builds the rest, as for
        # a new space's first write.
        await ensure_vector_index(
            self._pool, target.dimension, migration.target_slot, first_partition_only=self._distributed
        )
        return await self._release(row)

    async def _release(self, row: asyncpg.Record) -> EmbeddingMigration:
        """The started migration `row`, its start's hold released: the runners may claim it. In a
        transaction that declares its subject (release_started_migration checks it)."""
        async with tenant_transaction(
            self._pool, _subject(row["namespace"], row["agent"], row["kb_ref"])
        ) as conn:
            released = await conn.fetchrow("SELECT * FROM release_started_migration($1)", row["id"])
        return _migration(released if released is not None else row)

    async def _create_for_base(self, migration: KnowledgeBaseMigration) -> EmbeddingMigration | None:
        target, after = migration.target, migration.target_chunking
        async with tenant_transaction(self._pool, _of(migration)) as conn:
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
            # The source pins are the base's as the database has them (the function reads them).
            row = await conn.fetchrow(
                "SELECT * FROM start_knowledge_migration($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
                "$12, $13)",
                migration.id,
                migration.namespace,
                migration.kb_ref,
                migration.from_generation,
                target.name,
                target.model,
                target.dimension,
                target.normalized,
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
        if row is None:
            return None
        # After the row, as for a space.
        async with self._pool.acquire() as conn:
            await conn.execute("SELECT ensure_chunk_vector_index($1)", target.dimension)
        return await self._release(row)

    async def get(self, migration_id: str) -> EmbeddingMigration | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                f"SELECT {_SERVED} FROM embedding_migrations WHERE id = $1", migration_id
            )
        return None if row is None else _migration(row)

    async def page(self, *, limit: int, before: tuple[datetime, str] | None) -> list[EmbeddingMigration]:
        params: list[Any] = [limit]
        where = ""
        if before is not None:
            params += [before[0], before[1]]
            where = "WHERE (created_at, id) < ($2, $3::uuid) "
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_SERVED} FROM embedding_migrations {where}ORDER BY created_at DESC, id DESC LIMIT $1",
                *params,
            )
        return [_migration(row) for row in rows]

    async def active(self) -> list[EmbeddingMigration]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_SERVED} FROM embedding_migrations WHERE state <> ALL($1::text[]) ORDER BY created_at, id",
                _FINISHED,
            )
        return [_migration(row) for row in rows]

    async def transition(
        self, migration_id: str, *, expect: Sequence[MigrationState], state: MigrationState, reason: str = ""
    ) -> EmbeddingMigration | None:
        # The operator cancels and resumes (the serving role); the runner finishes and pauses.
        pool, function = (
            (self._runner, "finish_migration")
            if state in _RUNNER_STATES
            else (self._pool, "change_migration_state")
        )
        async with pool.acquire() as conn:
            subject = await conn.fetchrow(
                "SELECT namespace, agent, kb_ref FROM embedding_migrations WHERE id = $1", migration_id
            )
        if subject is None:
            return None
        async with tenant_transaction(pool, _subject(*subject)) as conn:
            # The function locks the subject row first (0015's lock order): a cancel is ordered
            # with every write of it.
            row = await conn.fetchrow(
                f"SELECT * FROM {function}($1, $2::text[], $3, $4)",
                migration_id,
                [s.value for s in expect],
                state.value,
                reason,
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
        async with self._runner.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT * FROM claim_migration($1, $2, $3::text[], $4, $5::uuid[])",
                runner,
                lease_seconds,
                list(embedders),
                retire_after_seconds,
                list(busy),
            )
        return None if row is None or row["id"] is None else _migration(row)

    async def pending(self, migration: MemorySpaceMigration, *, limit: int) -> list[PendingMemory]:
        try:
            async with tenant_transaction(self._runner, _of(migration)) as conn:
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
        migration: MemorySpaceMigration,
        runner: str,
        rows: Sequence[tuple[PendingMemory, np.ndarray]],
        *,
        lease_seconds: float,
    ) -> MemorySpaceMigration | None:
        last = rows[-1][0] if rows else None
        async with tenant_transaction(self._runner, _of(migration)) as conn:
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
            row = await _progress(
                conn,
                migration,
                runner,
                written,
                cursor=None if last is None else (last.bucket, last.id),
                lease_seconds=lease_seconds,
            )
        return None if row is None else _space_migration(row)

    async def renew(self, migration: EmbeddingMigration, runner: str, *, lease_seconds: float) -> bool:
        async with self._runner.acquire() as conn:
            return bool(
                await conn.fetchval("SELECT renew_migration($1, $2, $3)", migration.id, runner, lease_seconds)
            )

    async def rewind(self, migration: EmbeddingMigration, runner: str) -> bool:
        async with self._runner.acquire() as conn:
            return bool(await conn.fetchval("SELECT rewind_migration($1, $2)", migration.id, runner))

    async def cut_over(self, migration: EmbeddingMigration, runner: str) -> bool:
        match migration:
            case MemorySpaceMigration():
                function = "cut_over_memory_space"
            case KnowledgeBaseMigration():
                function = "cut_over_knowledge_base"
        async with tenant_transaction(self._runner, _of(migration)) as conn:
            done = await conn.fetchval(f"SELECT {function}($1, $2)", migration.id, runner)
        if done and isinstance(migration, KnowledgeBaseMigration):
            await recount(
                self._runner, migration.namespace, migration.kb_ref, self._statistics
            )  # new generation's
        return bool(done)

    async def clear_slot(
        self, migration: EmbeddingMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        try:
            async with tenant_transaction(self._runner, _of(migration)) as conn:
                match migration:
                    case MemorySpaceMigration():
                        # Locks the space row and the migration row itself, after its batch (0020).
                        function = "migration_clear"
                    case KnowledgeBaseMigration():
                        await conn.execute(
                            "SELECT lock_migration_subject($1, false)", migration.id
                        )  # lock order
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

    async def pending_documents(
        self, migration: KnowledgeBaseMigration, *, limit: int
    ) -> list[PendingDocument]:
        try:
            async with tenant_transaction(self._runner, _of(migration)) as conn:
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
                                location_from(row["location"]),
                            )
                        )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _NOT_LEASED:
                return []
            raise
        return [
            PendingDocument(
                d["ref"],
                d["version"],
                d["content_sha256"],
                d["text"],
                tuple(chunks.get(d["ref"], ())),
                spans_from(d["source_spans"]),
            )
            for d in documents
        ]

    async def store_documents(
        self,
        migration: KnowledgeBaseMigration,
        runner: str,
        documents: Sequence[tuple[PendingDocument, Sequence[ChunkRow]]],
        *,
        lease_seconds: float,
    ) -> KnowledgeBaseMigration | None:
        positions = [position for position, (_, chunks) in enumerate(documents, 1) for _ in chunks]
        chunks = [chunk for _, rows in documents for chunk in rows]
        async with tenant_transaction(self._runner, _of(migration)) as conn:
            if not await _hold(conn, migration.id, runner):
                return None
            written = await conn.fetchval(
                "SELECT kb_migration_store($1, $2, $3::text[], $4::bigint[], $5::bytea[], $6::int[], "
                "$7::int[], $8::text[], $9::int[], $10::int[], $11::text[], $12::vector[], $13::text[])",
                migration.id,
                runner,
                [document.ref for document, _ in documents],
                [document.version for document, _ in documents],
                [document.content_sha256 for document, _ in documents],
                positions,
                *chunk_columns(chunks),
            )
            row = await _progress(
                conn,
                migration,
                runner,
                written,
                document=documents[-1][0].ref if documents else None,
                lease_seconds=lease_seconds,
            )
        return None if row is None else _base_migration(row)

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
        async with self._runner.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT * FROM migration_failed($1, $2, $3, $4)", migration.id, runner, reason, pause_after
            )
        return None if row is None or row["id"] is None else _migration(row)
