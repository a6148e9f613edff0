"""Background ingestion in PostgreSQL (the contract: `tokensvc.storage.ingestion_ports.IngestionStore`).

An upload and a version's finish run under the document's advisory lock (the one synchronous
writes take), so they are ordered with each other; the runner's other writes lock the ingestion
row and check its lease in the same transaction. The claim across namespaces is the owner's
function (functions/ingestion.sql); everything else runs as the serving role under the
ingestion's tenant (row-level security).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from typing import Any

import asyncpg
import numpy as np
from pgvector import Vector

from tokensvc.storage.ingestion_records import (
    Enqueued,
    Extracted,
    Ingestion,
    IngestionQueue,
    IngestionState,
    StagedChunk,
)
from tokensvc.storage.ports import StaleKnowledgeBases
from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.ingestion_rows import INGESTION_COLUMNS, ingestion_from
from tokensvc.storage.postgres.knowledge import (
    DOC_FIELDS,
    base_with_migration,
    document_from,
    update_metadata,
)
from tokensvc.storage.postgres.locations import location_from, location_json, spans_json
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.postgres.text_statistics import TEXT_STATISTICS, TextStatisticsPolicy, recount
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, BaseRow, DocumentRow, Tenant

__all__ = ["PostgresIngestionStore"]

# The lease a runner's write needs: its own, unexpired.
_HELD = "namespace = $1 AND id = $2 AND lease_owner = $3 AND lease_until >= statement_timestamp()"


def _tenant(job: Ingestion) -> Tenant:
    return Tenant(job.namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))


@translate_errors
class PostgresIngestionStore:
    """`pool`: the serving role's (uploads, the queue's counts); `runner_pool`: the runner role's
    (migration 0021), for everything the runner does: claims, leases, extraction, vectors,
    finish. None: this replica has no runner credential and runs no ingestion."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        runner_pool: asyncpg.Pool | None = None,
        *,
        statistics: TextStatisticsPolicy = TEXT_STATISTICS,
    ):
        self._pool = pool
        self._runner_pool = runner_pool
        self._statistics = statistics

    @property
    def _runner(self) -> asyncpg.Pool:
        if self._runner_pool is None:
            raise RuntimeError("this replica has no runner credential: it runs no ingestion")
        return self._runner_pool

    # --- uploads ----------------------------------------------------------------------------

    async def enqueue(
        self,
        tenant: Tenant,
        *,
        kb_ref: str,
        ref: str,
        content_type: str,
        content_sha256: bytes,
        size_bytes: int,
        metadata: dict[str, Any],
        content: bytes,
    ) -> Enqueued | None:
        ns = tenant.namespace
        keys = (ns, kb_ref, ref)
        async with tenant_transaction(self._pool, tenant, lock=f"{ns}/{kb_ref}/{ref}") as conn:
            # The base FOR SHARE and the document row FOR UPDATE, as a synchronous write takes them.
            stored = await conn.fetchrow("SELECT * FROM document_write_state($1, $2, $3, NULL)", *keys)
            if stored is None or stored["generation"] is None:
                return None
            # Under the lock no other upload or finish changes either (a runner's progress may).
            row = await conn.fetchrow(
                f"SELECT {', '.join(f'd.{c} AS d_{c}' for c in DOC_FIELDS)}, "
                f"{', '.join(f'i.{c} AS i_{c}' for c in INGESTION_COLUMNS.split(', '))} FROM knowledge_bases b "
                "LEFT JOIN documents d ON d.namespace = b.namespace AND d.kb_ref = b.ref AND d.ref = $3 "
                "LEFT JOIN ingestions i ON i.namespace = b.namespace AND i.kb_ref = b.ref AND i.doc_ref = $3 "
                "WHERE b.namespace = $1 AND b.ref = $2",
                *keys,
            )
            assert row is not None
            queued = None if row["i_id"] is None else ingestion_from(row, "i_")
            searchable = stored["version"]
            if (
                queued is not None
                and queued.state is not IngestionState.FAILED
                and queued.content_sha256 == content_sha256
            ):
                if queued.metadata != metadata:
                    row = await conn.fetchrow(
                        "SELECT * FROM relabel_ingestion($1, $2, $3)", ns, uuid.UUID(queued.id), metadata
                    )
                    assert row is not None
                    queued = ingestion_from(row)
                return Enqueued(queued.as_document(searchable), unchanged=True, ingestion=queued)
            if searchable is not None and bytes(stored["content_sha256"]) == content_sha256:
                # The searchable version is what this upload asks for: a newer queued one goes.
                if queued is not None:
                    await conn.execute(
                        "DELETE FROM ingestions WHERE namespace = $1 AND id = $2", ns, uuid.UUID(queued.id)
                    )
                document = document_from({c: row[f"d_{c}"] for c in DOC_FIELDS})
                if document.metadata != metadata:
                    document = await update_metadata(conn, keys, metadata)
                return Enqueued(document, unchanged=True, ingestion=None)
            # The next version, replacing a queued or failed one: the owner's function writes it.
            row = await conn.fetchrow(
                "SELECT * FROM queue_ingestion($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                *keys,
                None if queued is None else uuid.UUID(queued.id),
                uuid.uuid4(),
                max(searchable or 0, 0 if queued is None else queued.version) + 1,
                content_type,
                content_sha256,
                size_bytes,
                metadata,
                content,
            )
        assert row is not None
        created = ingestion_from(row)
        return Enqueued(created.as_document(searchable), unchanged=False, ingestion=created)

    # --- the runner (functions/ingestion.sql, each checking its lease) ------------------------

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> Ingestion | None:
        async with self._runner.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT * FROM claim_ingestion($1, $2, $3::uuid[])",
                runner,
                lease_seconds,
                [uuid.UUID(job) for job in busy],
            )
        return None if row is None else ingestion_from(row)

    async def claim_one(self, job: Ingestion, runner: str, *, lease_seconds: float) -> Ingestion | None:
        return await self._one(job, "claim_this_ingestion($1, $2, $3, $4)", runner, lease_seconds)

    async def renew(self, job: Ingestion, runner: str, *, lease_seconds: float) -> bool:
        async with tenant_transaction(self._runner, _tenant(job)) as conn:
            renewed = await conn.fetchval(
                "SELECT renew_ingestion($1, $2, $3, $4)",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                lease_seconds,
            )
        return bool(renewed)

    async def record_failure(
        self, job: Ingestion, runner: str, reason: str, *, pause_after: int
    ) -> Ingestion | None:
        return await self._one(job, "ingestion_failed($1, $2, $3, $4, $5)", runner, reason, pause_after)

    async def content(self, job: Ingestion, runner: str) -> bytes | None:
        rows = await self._leased(job, "SELECT ingestion_bytes($1, $2, $3) AS content", runner)
        return None if rows is None else rows[0]["content"]

    async def base_of(self, job: Ingestion, runner: str) -> BaseRow | None:
        rows = await self._leased(
            job, "SELECT *, 0::bigint AS document_count FROM ingestion_base($1, $2, $3)", runner
        )
        return None if not rows else base_with_migration(rows[0])

    async def store_extraction(self, job: Ingestion, runner: str, extracted: Extracted) -> Ingestion | None:
        chunks = extracted.chunks
        return await self._one(
            job,
            "stage_ingestion($1, $2, $3, $4, $5::uuid, $6, $7::jsonb, $8, $9::boolean[], $10::int[], $11::text[], "
            "$12::int[], $13::int[], $14::text[], $15::text[])",
            runner,
            extracted.generation,
            extracted.migration,
            extracted.text,
            spans_json(extracted.spans),
            extracted.content_type,
            [c.target for c in chunks],
            [c.index for c in chunks],
            [c.text for c in chunks],
            [c.start for c in chunks],
            [c.end for c in chunks],
            # JSON text per chunk: asyncpg would read a list of lists as a 2-D array.
            [json.dumps(list(c.heading_path)) for c in chunks],
            [location_json(c.location) for c in chunks],
        )

    async def unembedded(self, job: Ingestion, runner: str, *, limit: int) -> list[StagedChunk] | None:
        rows = await self._leased(job, "SELECT * FROM ingestion_unembedded($1, $2, $3, $4)", runner, limit)
        if rows is None:
            return None
        return [
            StagedChunk(
                row["chunk_index"],
                row["text"],
                row["start_offset"],
                row["end_offset"],
                tuple(row["heading_path"]),
                location_from(row["location"]),
                target=row["target"],
            )
            for row in rows
        ]

    async def store_vectors(
        self, job: Ingestion, runner: str, vectors: Sequence[tuple[StagedChunk, np.ndarray]]
    ) -> Ingestion | None:
        return await self._one(
            job,
            "store_ingestion_vectors($1, $2, $3, $4::boolean[], $5::int[], $6::vector[])",
            runner,
            [chunk.target for chunk, _ in vectors],
            [chunk.index for chunk, _ in vectors],
            [Vector(vector) for _, vector in vectors],
        )

    async def finish(self, job: Ingestion, runner: str) -> DocumentRow | None:
        lock = f"{job.namespace}/{job.kb_ref}/{job.doc_ref}"  # the document's, as uploads take it
        async with tenant_transaction(self._runner, _tenant(job), lock=lock) as conn:
            row = await conn.fetchrow(
                "SELECT * FROM finish_ingestion($1, $2, $3)", job.namespace, uuid.UUID(job.id), runner
            )
        assert row is not None
        if row["outcome"] == "stale":
            raise StaleKnowledgeBases()
        if row["outcome"] != "ready":
            return None
        await recount(self._runner, job.namespace, job.kb_ref, self._statistics)  # the base's, when stale
        return document_from({column: row[column] for column in DOC_FIELDS})

    async def fail(self, job: Ingestion, runner: str, reason: str) -> Ingestion | None:
        return await self._one(job, "fail_ingestion($1, $2, $3, $4)", runner, reason)

    async def discard(self, job: Ingestion, runner: str) -> bool:
        async with tenant_transaction(self._runner, _tenant(job)) as conn:
            gone = await conn.fetchval(
                "SELECT discard_ingestion($1, $2, $3)", job.namespace, uuid.UUID(job.id), runner
            )
        return bool(gone)

    async def get(self, job: Ingestion) -> Ingestion | None:
        async with tenant_transaction(self._runner, _tenant(job)) as conn:
            row = await conn.fetchrow(
                "SELECT * FROM runner_ingestion($1, $2)", job.namespace, uuid.UUID(job.id)
            )
        return None if row is None else ingestion_from(row)

    async def _leased(
        self, job: Ingestion, query: str, runner: str, *arguments: Any
    ) -> list[asyncpg.Record] | None:
        """The rows of a read that needs the lease (its function raises TI001 without it: None)."""
        try:
            async with tenant_transaction(self._runner, _tenant(job)) as conn:
                try:
                    rows: list[asyncpg.Record] = await conn.fetch(
                        query, job.namespace, uuid.UUID(job.id), runner, *arguments
                    )
                except asyncpg.PostgresError as exc:
                    if exc.sqlstate == _LEASE_NOT_HELD:
                        raise _LeaseLost from None
                    raise
        except _LeaseLost:
            return None
        return rows

    async def _one(self, job: Ingestion, call: str, runner: str, *arguments: Any) -> Ingestion | None:
        """The ingestion one of the runner's functions returns (None: it returned none), called
        in a transaction that declared the ingestion's namespace."""
        async with tenant_transaction(self._runner, _tenant(job)) as conn:
            row = await conn.fetchrow(
                f"SELECT * FROM {call}", job.namespace, uuid.UUID(job.id), runner, *arguments
            )
        return None if row is None else ingestion_from(row)

    async def queue(self) -> IngestionQueue:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM ingestion_queue()")
        assert row is not None
        return IngestionQueue(row["pending"], row["processing"], row["failed"], row["oldest_seconds"])


_LEASE_NOT_HELD = "TI001"  # raised by tokensvc.held_ingestion (functions/ingestion.sql)


class _LeaseLost(Exception):
    """The runner's lease on an ingestion was not held: its read returns None."""
