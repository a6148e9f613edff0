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
from tokensvc.storage.postgres.knowledge import DOC_COLUMNS, document_from, update_metadata
from tokensvc.storage.postgres.locations import location_from, location_json, spans_json
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, DocumentRow, Tenant

__all__ = ["PostgresIngestionStore"]

# The lease a runner's write needs: its own, unexpired.
_HELD = "namespace = $1 AND id = $2 AND lease_owner = $3 AND lease_until >= statement_timestamp()"


def _tenant(job: Ingestion) -> Tenant:
    return Tenant(job.namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))


@translate_errors
class PostgresIngestionStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

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
            row = await conn.fetchrow(
                f"SELECT {INGESTION_COLUMNS} FROM ingestions WHERE namespace = $1 AND kb_ref = $2 AND doc_ref = $3 FOR UPDATE",
                *keys,
            )
            queued = None if row is None else ingestion_from(row)
            searchable = stored["version"]
            if (
                queued is not None
                and queued.state is not IngestionState.FAILED
                and queued.content_sha256 == content_sha256
            ):
                if queued.metadata != metadata:
                    row = await conn.fetchrow(
                        "UPDATE ingestions SET metadata = $3, updated_at = statement_timestamp() "
                        f"WHERE namespace = $1 AND id = $2 RETURNING {INGESTION_COLUMNS}",
                        ns,
                        uuid.UUID(queued.id),
                        metadata,
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
                document = await update_metadata(conn, keys, metadata)
                return Enqueued(document, unchanged=True, ingestion=None)
            version = max(searchable or 0, 0 if queued is None else queued.version) + 1
            if queued is not None:
                await conn.execute(
                    "DELETE FROM ingestions WHERE namespace = $1 AND id = $2", ns, uuid.UUID(queued.id)
                )
            row = await conn.fetchrow(
                "WITH queued AS (INSERT INTO ingestions (namespace, id, kb_ref, doc_ref, version, content_type, "
                "content_sha256, size_bytes, metadata) VALUES ($1, $4, $2, $3, $5, $6, $7, $8, $9) "
                f"RETURNING {INGESTION_COLUMNS}), "
                "bytes AS (INSERT INTO ingestion_content (namespace, ingestion, kb_ref, content) "
                "SELECT namespace, id, kb_ref, $10 FROM queued RETURNING 1) "
                "SELECT * FROM queued",
                *keys,
                uuid.uuid4(),
                version,
                content_type,
                content_sha256,
                size_bytes,
                metadata,
                content,
            )
        assert row is not None
        created = ingestion_from(row)
        return Enqueued(created.as_document(searchable), unchanged=False, ingestion=created)

    # --- the runner's lease -----------------------------------------------------------------

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> Ingestion | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT * FROM claim_ingestion($1, $2, $3::uuid[])",
                runner,
                lease_seconds,
                [uuid.UUID(job) for job in busy],
            )
        return None if row is None else ingestion_from(row)

    async def claim_one(self, job: Ingestion, runner: str, *, lease_seconds: float) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            row = await conn.fetchrow(
                "UPDATE ingestions SET lease_owner = $3, "
                "lease_until = statement_timestamp() + make_interval(secs => $4) "
                "WHERE namespace = $1 AND id = $2 AND state <> 'failed' AND (lease_owner IS NULL "
                f"OR lease_owner = $3 OR lease_until < statement_timestamp()) RETURNING {INGESTION_COLUMNS}",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                lease_seconds,
            )
        return None if row is None else ingestion_from(row)

    async def renew(self, job: Ingestion, runner: str, *, lease_seconds: float) -> bool:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            renewed = await conn.fetchval(
                "UPDATE ingestions SET lease_until = statement_timestamp() + make_interval(secs => $4) "
                "WHERE namespace = $1 AND id = $2 AND lease_owner = $3 AND state <> 'failed' RETURNING true",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                lease_seconds,
            )
        return bool(renewed)

    async def record_failure(
        self, job: Ingestion, runner: str, reason: str, *, pause_after: int
    ) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            row = await conn.fetchrow(
                "UPDATE ingestions SET failures = failures + 1, reason = $4, "
                "state = CASE WHEN failures + 1 >= $5 THEN 'failed' ELSE state END, "
                "lease_owner = CASE WHEN failures + 1 >= $5 THEN NULL ELSE lease_owner END, "
                "lease_until = CASE WHEN failures + 1 >= $5 THEN NULL ELSE lease_until END, "
                f"updated_at = statement_timestamp() WHERE {_HELD} RETURNING {INGESTION_COLUMNS}",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                reason,
                pause_after,
            )
            if row is not None and row["state"] == IngestionState.FAILED:
                await _drop_staged(conn, job)
        return None if row is None else ingestion_from(row)

    # --- the runner's work ------------------------------------------------------------------

    async def content(self, job: Ingestion, runner: str) -> bytes | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            content: bytes | None = await conn.fetchval(
                "SELECT c.content FROM ingestion_content c WHERE c.namespace = $1 AND c.ingestion = $2 "
                f"AND EXISTS (SELECT FROM ingestions WHERE {_HELD})",
                job.namespace,
                uuid.UUID(job.id),
                runner,
            )
        return content

    async def store_extraction(self, job: Ingestion, runner: str, extracted: Extracted) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            if not await _hold(conn, job, runner):
                return None
            await conn.execute(
                "DELETE FROM ingestion_chunks WHERE namespace = $1 AND ingestion = $2",
                job.namespace,
                uuid.UUID(job.id),
            )
            if extracted.chunks:
                await conn.execute(
                    "INSERT INTO ingestion_chunks (namespace, ingestion, kb_ref, chunk_index, text, start_offset, "
                    "end_offset, heading_path, location) "
                    "SELECT $1, $2, $3, u.idx, u.text, u.start_offset, u.end_offset, "
                    "ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), u.location::jsonb "
                    "FROM unnest($4::int[], $5::text[], $6::int[], $7::int[], $8::text[], $9::text[]) "
                    "AS u(idx, text, start_offset, end_offset, heading, location) "
                    # On Citus this makes the insert a shard's INSERT ... SELECT (a COPY otherwise,
                    # which row-level security refuses).
                    "RETURNING chunk_index",
                    job.namespace,
                    uuid.UUID(job.id),
                    job.kb_ref,
                    *_staged_columns(extracted.chunks),
                )
            await conn.execute(
                "UPDATE ingestion_content SET text = $3, source_spans = $4::jsonb, media_type = $5 "
                "WHERE namespace = $1 AND ingestion = $2",
                job.namespace,
                uuid.UUID(job.id),
                extracted.text,
                spans_json(extracted.spans),
                extracted.content_type,
            )
            row = await conn.fetchrow(
                "UPDATE ingestions SET state = 'processing', chunks_total = $3, chunks_done = 0, generation = $4, "
                "failures = 0, reason = '', updated_at = statement_timestamp() "
                f"WHERE namespace = $1 AND id = $2 RETURNING {INGESTION_COLUMNS}",
                job.namespace,
                uuid.UUID(job.id),
                len(extracted.chunks),
                extracted.generation,
            )
        assert row is not None
        return ingestion_from(row)

    async def unembedded(self, job: Ingestion, runner: str, *, limit: int) -> list[StagedChunk] | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            rows = await conn.fetch(
                # One row of NULLs when the lease is held and nothing is left; none when it is not.
                "SELECT c.* FROM (SELECT 1 FROM ingestions WHERE " + _HELD + ") held "
                "LEFT JOIN LATERAL (SELECT chunk_index, text, start_offset, end_offset, heading_path, location "
                "FROM ingestion_chunks WHERE namespace = $1 AND ingestion = $2 AND embedding IS NULL "
                "ORDER BY chunk_index LIMIT $4) c ON true",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                limit,
            )
        if not rows:
            return None
        return [
            StagedChunk(
                row["chunk_index"],
                row["text"],
                row["start_offset"],
                row["end_offset"],
                tuple(row["heading_path"]),
                location_from(row["location"]),
            )
            for row in rows
            if row["chunk_index"] is not None
        ]

    async def store_vectors(
        self, job: Ingestion, runner: str, vectors: Sequence[tuple[int, np.ndarray]]
    ) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            if not await _hold(conn, job, runner):
                return None
            indexes = [index for index, _ in vectors]
            # Each chunk once: a batch written again (a retry after a lost reply) changes nothing.
            status = await conn.execute(
                "UPDATE ingestion_chunks SET dimension = $5, "
                "embedding = ($4::vector[])[array_position($3::int[], chunk_index)] "
                "WHERE namespace = $1 AND ingestion = $2 AND chunk_index = ANY($3::int[]) AND embedding IS NULL",
                job.namespace,
                uuid.UUID(job.id),
                indexes,
                [Vector(vector) for _, vector in vectors],
                max((int(vector.shape[0]) for _, vector in vectors[:1]), default=1),
            )
            written = int(status.split()[-1])
            row = await conn.fetchrow(
                "UPDATE ingestions SET chunks_done = chunks_done + $3, failures = 0, reason = '', "
                f"updated_at = statement_timestamp() WHERE namespace = $1 AND id = $2 RETURNING {INGESTION_COLUMNS}",
                job.namespace,
                uuid.UUID(job.id),
                written,
            )
        assert row is not None
        return ingestion_from(row)

    async def finish(self, job: Ingestion, runner: str) -> DocumentRow | None:
        ns, kb_ref, doc_ref = job.namespace, job.kb_ref, job.doc_ref
        keys = (ns, kb_ref, doc_ref)
        async with tenant_transaction(self._pool, _tenant(job), lock=f"{ns}/{kb_ref}/{doc_ref}") as conn:
            stored = await conn.fetchrow("SELECT * FROM document_write_state($1, $2, $3, NULL)", *keys)
            assert stored is not None
            held = await _hold(conn, job, runner)
            if held is None or held.generation is None or held.chunks_total is None:
                return None  # not held, or not extracted yet
            if stored["version"] is not None and stored["version"] >= held.version:
                # A synchronous upload (`replace_document`) wrote a version at least as new.
                await conn.execute(
                    "DELETE FROM ingestions WHERE namespace = $1 AND id = $2", ns, uuid.UUID(job.id)
                )
                return None
            stale = held.generation != stored["generation"]
            if stale:
                # Cut over since the chunks were staged: they are the old pins'. Start again.
                await _drop_staged(conn, job)
                await conn.execute(
                    "UPDATE ingestions SET state = 'pending', generation = NULL, chunks_total = NULL, "
                    "chunks_done = 0, updated_at = statement_timestamp() WHERE namespace = $1 AND id = $2",
                    ns,
                    uuid.UUID(job.id),
                )
            elif held.chunks_done < held.chunks_total:
                return None
            else:
                document = await _swap_version(conn, held, new=stored["version"] is None)
        if stale:
            raise StaleKnowledgeBases()
        return document

    async def fail(self, job: Ingestion, runner: str, reason: str) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            row = await conn.fetchrow(
                "UPDATE ingestions SET state = 'failed', reason = $4, lease_owner = NULL, lease_until = NULL, "
                f"updated_at = statement_timestamp() WHERE {_HELD} RETURNING {INGESTION_COLUMNS}",
                job.namespace,
                uuid.UUID(job.id),
                runner,
                reason,
            )
            if row is not None:
                await _drop_staged(conn, job)
        return None if row is None else ingestion_from(row)

    async def discard(self, job: Ingestion, runner: str) -> bool:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            # A failed one has no lease any more: the runner that failed it may still discard it.
            gone = await conn.fetchval(
                "DELETE FROM ingestions WHERE namespace = $1 AND id = $2 AND (state = 'failed' "
                "OR (lease_owner = $3 AND lease_until >= statement_timestamp())) RETURNING true",
                job.namespace,
                uuid.UUID(job.id),
                runner,
            )
        return bool(gone)

    # --- reads ------------------------------------------------------------------------------

    async def get(self, job: Ingestion) -> Ingestion | None:
        async with tenant_transaction(self._pool, _tenant(job)) as conn:
            row = await conn.fetchrow(
                f"SELECT {INGESTION_COLUMNS} FROM ingestions WHERE namespace = $1 AND id = $2",
                job.namespace,
                uuid.UUID(job.id),
            )
        return None if row is None else ingestion_from(row)

    async def queue(self) -> IngestionQueue:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM ingestion_queue()")
        assert row is not None
        return IngestionQueue(row["pending"], row["processing"], row["failed"], row["oldest_seconds"])


async def _hold(conn: asyncpg.Connection, job: Ingestion, runner: str) -> Ingestion | None:
    """The ingestion, locked, when `runner` holds its lease."""
    row = await conn.fetchrow(
        f"SELECT {INGESTION_COLUMNS} FROM ingestions WHERE {_HELD} FOR UPDATE",
        job.namespace,
        uuid.UUID(job.id),
        runner,
    )
    return None if row is None else ingestion_from(row)


async def _drop_staged(conn: asyncpg.Connection, job: Ingestion) -> None:
    await conn.execute(
        "DELETE FROM ingestion_chunks WHERE namespace = $1 AND ingestion = $2",
        job.namespace,
        uuid.UUID(job.id),
    )


def _staged_columns(chunks: Sequence[StagedChunk]) -> list[Any]:
    return [
        [c.index for c in chunks],
        [c.text for c in chunks],
        [c.start for c in chunks],
        [c.end for c in chunks],
        # JSON text per chunk: asyncpg would read a list of lists as a 2-D array.
        [json.dumps(list(c.heading_path)) for c in chunks],
        [location_json(c.location) for c in chunks],
    ]


async def _swap_version(conn: asyncpg.Connection, job: Ingestion, *, new: bool) -> DocumentRow:
    """The version's swap, in the finish's transaction (under the document's lock): the document
    row written from the ingestion and its extraction (a new row, or the next version of the
    existing one, whose chunks of every generation go), its chunks copied from the staging table
    into `chunks` for the base's generation, the ingestion gone (its bytes and staged chunks
    cascade). `migrated_version` is reset: a running re-embedding migration embeds the new
    version for its target in its next pass."""
    keys = (job.namespace, job.kb_ref, job.doc_ref)
    extracted = await conn.fetchrow(
        "SELECT text, source_spans, media_type FROM ingestion_content WHERE namespace = $1 AND ingestion = $2",
        job.namespace,
        uuid.UUID(job.id),
    )
    assert extracted is not None
    values = (
        job.version,
        extracted["media_type"] or job.content_type,
        job.content_sha256,
        job.size_bytes,
        job.chunks_total,
        job.metadata,
        extracted["text"],
        extracted["source_spans"],
    )
    if new:
        row = await conn.fetchrow(
            f"INSERT INTO documents ({DOC_COLUMNS}, text, source_spans) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, clock_timestamp(), $10, $11) "
            f"RETURNING {DOC_COLUMNS}",
            *keys,
            *values,
        )
    else:
        row = await conn.fetchrow(
            "UPDATE documents SET version = $4, content_type = $5, content_sha256 = $6, size_bytes = $7, "
            "chunk_count = $8, metadata = $9, text = $10, source_spans = $11, migrated_version = NULL, "
            "migrated_chunk_count = NULL, updated_at = statement_timestamp() "
            f"WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING {DOC_COLUMNS}",
            *keys,
            *values,
        )
        await conn.execute(
            "DELETE FROM chunks WHERE namespace = $1 AND kb_ref = $2 AND doc_ref = $3 AND version < $4",
            *keys,
            job.version,
        )
    assert row is not None
    # One shard's INSERT ... SELECT on Citus (the tables are co-located, the namespace is fixed).
    await conn.execute(
        "INSERT INTO chunks (namespace, kb_ref, doc_ref, generation, version, chunk_index, text, start_offset, "
        "end_offset, heading_path, metadata, dimension, embedding, text_config, location) "
        "SELECT s.namespace, s.kb_ref, $3, $5, $6, s.chunk_index, s.text, s.start_offset, s.end_offset, "
        "s.heading_path, $7, s.dimension, s.embedding, "
        "(SELECT b.text_config FROM knowledge_bases b WHERE b.namespace = $1 AND b.ref = $2), s.location "
        "FROM ingestion_chunks s WHERE s.namespace = $1 AND s.ingestion = $4 RETURNING chunk_index",
        *keys,
        uuid.UUID(job.id),
        job.generation,
        job.version,
        job.metadata,
    )
    await conn.execute(
        "DELETE FROM ingestions WHERE namespace = $1 AND id = $2", job.namespace, uuid.UUID(job.id)
    )
    return document_from(row)
