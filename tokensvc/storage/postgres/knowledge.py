"""Knowledge bases in PostgreSQL (the contract: `tokensvc.storage.ports.KnowledgeStore`).

A new document version is written in one transaction (the new chunks inserted, the old version's
deleted), serialised per document by a transaction-scoped advisory lock; foreign keys cascade
deletes to documents and chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import asyncpg
from pgvector import Vector

from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ports import StaleKnowledgeBases
from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.filter_sql import compile_filter
from tokensvc.storage.postgres.ingestion_rows import INGESTION_COLUMNS, ingestion_from
from tokensvc.storage.postgres.locations import location_from, location_json, spans_json
from tokensvc.storage.postgres.ranking import (
    Corpus,
    TextIndex,
    fetch_candidates,
)
from tokensvc.storage.postgres.tenant import literal, tenant_transaction
from tokensvc.storage.records import (
    BaseRow,
    ChunkingSpec,
    ChunkRow,
    DocumentRow,
    EmbedderSpec,
    KnowledgePins,
    PassageRow,
    SearchOutcome,
    SearchPlan,
    SourceSpan,
    Tenant,
)

__all__ = [
    "BASE_SELECT",
    "DOC_COLUMNS",
    "PostgresKnowledgeStore",
    "base_from",
    "chunk_columns",
    "document_from",
    "update_metadata",
]


# A chunk's neighbours are the chunks before and after it in the same document version.
_CORPUS = Corpus(
    statistics=True,
    table="chunks",
    partition=("namespace", "kb_ref", "doc_ref", "generation", "version"),
    local="chunk_index",
    order=("chunk_index",),
    columns=(
        "kb_ref",
        "doc_ref",
        "version",
        "chunk_index",
        "text",
        "start_offset",
        "end_offset",
        "heading_path",
        "location",
    ),
    key_types=("text", "text", "text", "integer", "bigint", "integer"),
)


_BASE_INSERTED = (
    "namespace, ref, display_name, embedder, model, dimension, normalized, chunking, chunk_size, "
    "chunk_overlap, text_config, created_at"
)
_BASE_COLUMNS = f"{_BASE_INSERTED}, generation"
# Reads cast the regconfig to its name.
BASE_SELECT = _BASE_COLUMNS.replace("text_config", "text_config::text AS text_config")
DOC_COLUMNS = "namespace, kb_ref, ref, version, content_type, content_sha256, size_bytes, chunk_count, metadata, created_at"
DOC_FIELDS = tuple(DOC_COLUMNS.split(", "))
_BASE_FIELDS = (*_BASE_COLUMNS.split(", "), "document_count")
_MIGRATION_FIELDS = (
    "id",
    "to_embedder",
    "to_model",
    "to_dimension",
    "to_normalized",
    "to_chunking",
    "to_chunk_size",
    "to_chunk_overlap",
)
_BASE_QUALIFIED = ", ".join(
    f"b.{c}::text AS {c}" if c == "text_config" else f"b.{c}" for c in _BASE_COLUMNS.split(", ")
)


def _insert_chunks(first: int, generation: str, dimension: str) -> str:
    """The INSERT of one generation's chunks, their columns in parameters $first.. $first+6."""
    p = [f"${first + i}" for i in range(_CHUNK_ARRAYS)]
    return f"""
    INSERT INTO chunks (namespace, kb_ref, doc_ref, generation, version, chunk_index, text, start_offset,
                        end_offset, heading_path, metadata, dimension, embedding, text_config, location)
    SELECT $1, $2, $3, {generation}, $4, u.idx, u.text, u.start_offset, u.end_offset,
           ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), $9, {dimension}, u.embedding,
           -- The corpus's pinned configuration, read here so no writer can differ.
           (SELECT b.text_config FROM knowledge_bases b WHERE b.namespace = $1 AND b.ref = $2),
           u.location::jsonb
    FROM unnest({p[0]}::int[], {p[1]}::text[], {p[2]}::int[], {p[3]}::int[], {p[4]}::text[], {p[5]}::vector[],
                {p[6]}::text[])
         AS u(idx, text, start_offset, end_offset, heading, embedding, location)
    -- Unused here; on Citus it makes the insert a shard's INSERT ... SELECT, where it would COPY
    -- into the shard otherwise, which row-level security refuses.
    RETURNING chunk_index
"""


_CHUNK_ARRAYS = 7


def chunk_columns(chunks: Sequence[ChunkRow]) -> list[Any]:
    """Chunks as the parallel arrays the chunk INSERTs unnest (index, text, start, end,
    heading path, vector, location)."""
    return [
        [c.index for c in chunks],
        [c.text for c in chunks],
        [c.start for c in chunks],
        [c.end for c in chunks],
        # JSON text per chunk: asyncpg would read a list of lists as a 2-D array.
        [json.dumps(list(c.heading_path)) for c in chunks],
        [Vector(c.embedding) for c in chunks],
        [location_json(c.location) for c in chunks],
    ]


def _dimension_of(chunks: Sequence[ChunkRow]) -> int:
    return max((int(c.embedding.shape[0]) for c in chunks[:1]), default=1)


async def update_metadata(
    conn: asyncpg.Connection, keys: tuple[str, str, str], metadata: dict[str, Any]
) -> DocumentRow:
    """Replace the current version's metadata (and its chunks' copy), under the document's lock."""
    row = await conn.fetchrow(
        "WITH doc AS (UPDATE documents SET metadata = $4, updated_at = statement_timestamp() "
        f"WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING {DOC_COLUMNS}), "
        "swept AS (UPDATE chunks SET metadata = $4 WHERE namespace = $1 AND kb_ref = $2 "
        "AND doc_ref = $3) SELECT * FROM doc",
        *keys,
        metadata,
    )
    assert row is not None
    return document_from(row)


def base_with_migration(row: asyncpg.Record) -> BaseRow:
    """A base read with its backfilling migration's columns (`m_*`, NULL: none), which an upload
    (an ingestion) writes target chunks for too."""
    base = BaseRow(**{name: row[name] for name in _BASE_FIELDS})
    if row["m_id"] is None:
        return base
    return replace(
        base,
        migration_id=str(row["m_id"]),
        migrating_to=EmbedderSpec(
            row["m_to_embedder"], row["m_to_model"], row["m_to_dimension"], row["m_to_normalized"]
        ),
        migrating_chunking=ChunkingSpec(
            row["m_to_chunking"], row["m_to_chunk_size"], row["m_to_chunk_overlap"]
        ),
    )


def base_from(row: asyncpg.Record) -> BaseRow:
    return BaseRow(**dict(row.items()))


def document_from(row: asyncpg.Record | dict[str, Any]) -> DocumentRow:
    values = dict(row.items())
    values["metadata"] = dict(values["metadata"])
    return DocumentRow(**values)


@translate_errors
class PostgresKnowledgeStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    # --- knowledge bases --------------------------------------------------------------------

    async def create_base(self, tenant: Tenant, base: BaseRow) -> tuple[BaseRow, bool]:
        async with tenant_transaction(self._pool, tenant) as conn:
            inserted = await conn.fetchrow(
                f"INSERT INTO knowledge_bases ({_BASE_INSERTED}) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::regconfig, now()) "
                # asyncpg reads a regconfig as its name; Citus refuses the (stable) cast in RETURNING.
                f"ON CONFLICT (namespace, ref) DO NOTHING RETURNING {_BASE_COLUMNS}",
                base.namespace,
                base.ref,
                base.display_name,
                base.embedder,
                base.model,
                base.dimension,
                base.normalized,
                base.chunking,
                base.chunk_size,
                base.chunk_overlap,
                base.text_config,
            )
            if inserted is not None:
                created = base_from(inserted)
            else:
                existing = await conn.fetchrow(
                    f"SELECT {BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                    "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                    "WHERE namespace = $1 AND ref = $2",
                    base.namespace,
                    base.ref,
                )
                assert existing is not None
                return base_from(existing), False
        async with self._pool.acquire() as conn:
            await conn.execute("SELECT ensure_chunk_vector_index($1)", created.dimension)
        return created, True

    async def get_bases(self, tenant: Tenant, refs: Sequence[str]) -> list[BaseRow]:
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                "WHERE namespace = $1 AND ref = ANY($2::text[]) ORDER BY ref",
                tenant.namespace,
                list(refs),
            )
        return [base_from(row) for row in rows]

    async def bases_for_search(
        self, tenant: Tenant, refs: Sequence[str]
    ) -> tuple[list[BaseRow], KnowledgePins | None]:
        return await self.get_bases(tenant, refs), None  # read now: nothing for the search to check

    async def list_bases(self, tenant: Tenant, *, after: str | None, limit: int) -> list[BaseRow]:
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                "WHERE namespace = $1 AND ref > $2 ORDER BY ref LIMIT $3",
                tenant.namespace,
                after or "",
                limit,
            )
        return [base_from(row) for row in rows]

    async def delete_base(self, tenant: Tenant, ref: str) -> int | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            # Both parts read the statement's snapshot: the documents the cascade deletes. Not a
            # subquery in RETURNING: Citus refuses one there; this statement it sends to one shard.
            count = await conn.fetchval(
                "WITH counted AS (SELECT count(*) AS n FROM (SELECT ref FROM documents WHERE namespace = $1 "
                "AND kb_ref = $2 UNION SELECT doc_ref FROM ingestions WHERE namespace = $1 AND kb_ref = $2) r), "
                "gone AS (DELETE FROM knowledge_bases WHERE namespace = $1 AND ref = $2 RETURNING 1) "
                "SELECT counted.n FROM counted, gone",
                tenant.namespace,
                ref,
            )
            if count is not None:
                # The base's unfinished migration goes with it (its chunks went with the documents).
                # A statement of its own: its snapshot, taken after the base row was locked, sees
                # a migration whose start committed while this waited for that lock.
                # Through the owner's function (0021): the serving role writes no migration row.
                await conn.execute("SELECT cancel_knowledge_base_migrations($1, $2)", tenant.namespace, ref)
        return None if count is None else int(count)

    # --- documents --------------------------------------------------------------------------

    async def document_state(
        self, tenant: Tenant, kb_ref: str, doc_ref: str
    ) -> tuple[BaseRow | None, DocumentRow | None]:
        async with tenant_transaction(self._pool, tenant) as conn:
            row = await conn.fetchrow(
                f"SELECT {_BASE_QUALIFIED}, 0::bigint AS document_count, "
                f"{', '.join(f'd.{c} AS d_{c}' for c in DOC_FIELDS)}, "
                f"{', '.join(f'm.{c} AS m_{c}' for c in _MIGRATION_FIELDS)}, "
                f"{', '.join(f'i.{c} AS i_{c}' for c in INGESTION_COLUMNS.split(', '))} FROM knowledge_bases b "
                "LEFT JOIN documents d ON d.namespace = b.namespace AND d.kb_ref = b.ref AND d.ref = $3 "
                # Its version on its way in, if any: what a reader sees as the newest.
                "LEFT JOIN ingestions i ON i.namespace = b.namespace AND i.kb_ref = b.ref AND i.doc_ref = $3 "
                # The base's backfilling migration: an upload writes its target's chunks too.
                "LEFT JOIN embedding_migrations m ON m.namespace = b.namespace AND m.kb_ref = b.ref "
                "AND m.state = 'backfilling' "
                "WHERE b.namespace = $1 AND b.ref = $2",
                tenant.namespace,
                kb_ref,
                doc_ref,
            )
        if row is None:
            return None, None
        base = base_with_migration(row)
        document = None if row["d_ref"] is None else document_from({c: row[f"d_{c}"] for c in DOC_FIELDS})
        if row["i_id"] is not None:
            document = ingestion_from(row, "i_").as_document(None if document is None else document.version)
        return base, document

    async def list_documents(
        self, tenant: Tenant, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow] | None:
        params: list[Any] = [tenant.namespace, kb_ref, after or "", limit]
        matching = "true" if filter_ is None else compile_filter(filter_, "newest_metadata", params)
        ingesting = ", ".join(f"i.{c} AS i_{c}" for c in INGESTION_COLUMNS.split(", "))
        async with tenant_transaction(self._pool, tenant) as conn:
            # No row: no such base; one row of NULLs: a base without (matching) documents. A
            # document's newest version is the one on its way in, if any (its metadata filters).
            rows = await conn.fetch(
                "WITH ready AS (SELECT * FROM documents WHERE namespace = $1 AND kb_ref = $2 AND ref > $3), "
                "ingesting AS (SELECT * FROM ingestions WHERE namespace = $1 AND kb_ref = $2 AND doc_ref > $3), "
                "newest AS (SELECT coalesce(i.doc_ref, d.ref) AS newest_ref, "
                "coalesce(i.metadata, d.metadata) AS newest_metadata, "
                f"{', '.join(f'd.{c}' for c in DOC_FIELDS)}, {ingesting} "
                "FROM ready d FULL JOIN ingesting i ON i.doc_ref = d.ref) "
                "SELECT n.* FROM knowledge_bases b LEFT JOIN LATERAL (SELECT * FROM newest "
                f"WHERE {matching} ORDER BY newest_ref LIMIT $4) n ON true WHERE b.namespace = $1 AND b.ref = $2",
                *params,
            )
        if not rows:
            return None
        documents = []
        for row in rows:
            if row["newest_ref"] is None:
                continue
            ready = None if row["ref"] is None else document_from({c: row[c] for c in DOC_FIELDS})
            if row["i_id"] is None:
                assert ready is not None
                documents.append(ready)
            else:
                documents.append(
                    ingestion_from(row, "i_").as_document(None if ready is None else ready.version)
                )
        return documents

    async def document_text(self, tenant: Tenant, kb_ref: str, doc_ref: str, version: int) -> str | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            text: str | None = await conn.fetchval(
                "SELECT coalesce(text, '') FROM documents WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 AND version = $4",
                tenant.namespace,
                kb_ref,
                doc_ref,
                version,
            )
        return text

    async def replace_document(
        self,
        tenant: Tenant,
        *,
        kb_ref: str,
        ref: str,
        content_type: str,
        content_sha256: bytes,
        size_bytes: int,
        metadata: dict[str, Any],
        chunks: Sequence[ChunkRow] | None,
        generation: int = 0,
        text: str | None = None,
        next_chunks: Sequence[ChunkRow] | None = None,
        migration_id: str | None = None,
        source_spans: Sequence[SourceSpan] = (),
    ) -> tuple[DocumentRow, bool] | None:
        """One transaction under the document's advisory lock (contract: the port's): the lock
        with the transaction's start, the current version and the base's generation read under
        it, then one write."""
        ns = tenant.namespace
        keys = (ns, kb_ref, ref)
        # Serialise writers of the same document; the first writer creates the row.
        async with tenant_transaction(self._pool, tenant, lock=f"{ns}/{kb_ref}/{ref}") as conn:
            # In this order: the base's generation FOR SHARE (a cutover or a cancel locks the base
            # row FOR UPDATE, so this write is ordered with them), the document row FOR UPDATE (a
            # migration runner's write of it committed before this, or waits), and whether
            # `migration_id` still backfills; see migration 0015.
            stored = await conn.fetchrow(
                "SELECT * FROM document_write_state($1, $2, $3, $4::uuid)", *keys, migration_id
            )
            assert stored is not None
            if stored["version"] is not None and stored["content_sha256"] == content_sha256:
                return await update_metadata(conn, keys, metadata), False
            if chunks is None:
                return None  # the content changed meanwhile: the caller chunks the new one
            if stored["generation"] is not None and stored["generation"] != generation:
                raise StaleKnowledgeBases()  # cut over since the caller read it: it chunks again
            # Parameters: $1-$3 the document, $4-$10 its columns, $11-$17 the chunks' columns,
            # $18 the generation, $19 its dimension, $20 the document's source spans; dual writes:
            # $21 the next generation's chunk count, $22-$28 their columns, $29 their dimension.
            parameters: list[Any] = [
                *keys,
                1 if stored["version"] is None else stored["version"] + 1,
                content_type,
                content_sha256,
                size_bytes,
                len(chunks),
                metadata,
                text,
                *chunk_columns(chunks),
                generation,
                _dimension_of(chunks),
                spans_json(source_spans),
            ]
            writes = [f"added AS ({_insert_chunks(11, '$18', '$19')})"]
            # Marked done for the migration only with its chunks; a new version is not.
            marker = ("NULL", "NULL")
            if next_chunks is not None and stored["dual_write"]:
                parameters += [len(next_chunks), *chunk_columns(next_chunks), _dimension_of(next_chunks)]
                writes.append(f"added_next AS ({_insert_chunks(22, '$18 + 1', '$29')})")
                marker = ("$4", "$21")
            if stored["version"] is None:
                document = (
                    f"INSERT INTO documents ({DOC_COLUMNS}, text, source_spans, migrated_version, "
                    f"migrated_chunk_count) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, clock_timestamp(), $10, "
                    f"$20::jsonb, {marker[0]}, {marker[1]}) RETURNING {DOC_COLUMNS}"
                )
            else:
                document = (
                    "UPDATE documents SET version = $4, content_type = $5, content_sha256 = $6, size_bytes = $7, "
                    f"chunk_count = $8, metadata = $9, text = $10, source_spans = $20::jsonb, "
                    f"migrated_version = {marker[0]}, "
                    f"migrated_chunk_count = {marker[1]}, updated_at = statement_timestamp() "
                    f"WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING {DOC_COLUMNS}"
                )
                writes.insert(
                    0,
                    "gone AS (DELETE FROM chunks WHERE namespace = $1 AND kb_ref = $2 AND doc_ref = $3 "
                    "AND version < $4)",
                )
            # One statement: the document row, the old version's chunks gone (of every
            # generation), the new ones in (the foreign key is checked at the statement's end,
            # when the document row exists).
            statement = f"WITH doc AS ({document}), {', '.join(writes)}"
            row = await conn.fetchrow(f"{statement} SELECT * FROM doc", *parameters)
        assert row is not None
        return document_from(row), True

    async def delete_document(self, tenant: Tenant, kb_ref: str, ref: str) -> int | None:
        # Under the document's lock, as an upload and an ingestion's finish: a finish that
        # committed meanwhile (a new document's row) is seen, and deleted, not missed.
        async with tenant_transaction(self._pool, tenant, lock=f"{tenant.namespace}/{kb_ref}/{ref}") as conn:
            # Its version on its way in goes too (the runner working on it loses its lease).
            count = await conn.fetchval(
                "WITH ready AS (DELETE FROM documents WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 "
                "RETURNING chunk_count), ingesting AS (DELETE FROM ingestions WHERE namespace = $1 "
                "AND kb_ref = $2 AND doc_ref = $3 RETURNING 0 AS chunk_count) "
                "SELECT sum(chunk_count) FROM (SELECT * FROM ready UNION ALL SELECT * FROM ingesting) gone",
                tenant.namespace,
                kb_ref,
                ref,
            )
        return None if count is None else int(count)

    # --- search -----------------------------------------------------------------------------

    async def search(
        self,
        tenant: Tenant,
        kb_refs: Sequence[str],
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        count_cap: int,
        filter_: Filter | None,
        generations: Sequence[int],
        expect: KnowledgePins | None = None,
    ) -> SearchOutcome[PassageRow]:
        if len(generations) != len(kb_refs):
            raise ValueError("one generation per knowledge base")

        def where(params: list[Any], searchable: bool) -> str:
            params += [tenant.namespace, list(kb_refs), list(generations)]
            ns, refs, gens = (f"${len(params) - 2 + i}" for i in range(3))
            # Each base's own generation: refs and generations are the index condition (of
            # chunks_kb_generation), the pairing a filter (it matters only while a base migrates).
            predicate = (
                f"namespace = {ns} AND kb_ref = ANY({refs}::text[]) AND generation = ANY({gens}::int[]) "
                f"AND generation = ({gens}::int[])[array_position({refs}::text[], kb_ref)]"
            )
            if searchable and filter_ is not None:
                predicate += f" AND ({compile_filter(filter_, 'metadata', params)})"
            return predicate

        def scope(params: list[Any]) -> str:
            params += [tenant.namespace, list(kb_refs), list(generations)]
            return f"${len(params) - 2}, ${len(params) - 1}::text[], ${len(params)}::int[]"

        try:
            rows, found = await fetch_candidates(
                self._pool,
                tenant,
                _CORPUS,
                plan,
                where,
                _passage,
                row_count=row_count,
                count_cap=count_cap,
                checks=() if expect is None else (_expectation(expect),),
                text_index=TextIndex("tokensvc.chunks_matching", scope, filtered=filter_ is not None),
            )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _STALE_PINS:
                raise StaleKnowledgeBases() from None
            raise
        return SearchOutcome(rows, found)


_STALE_PINS = "TS001"  # raised by tokensvc.expect_knowledge_bases (functions/knowledge.sql)


def _expectation(expect: KnowledgePins) -> str:
    def array(values: list[str], kind: str) -> str:
        return f"ARRAY[{', '.join(literal(v) for v in values)}]::{kind}[]"

    refs = [ref for ref, _, _ in expect.created]
    created = [moment.isoformat() for _, moment, _ in expect.created]
    generations = [str(generation) for _, _, generation in expect.created]
    return (
        f"SELECT expect_knowledge_bases({array(list(expect.roster), 'text')}, {array(refs, 'text')}, "
        f"{array(created, 'timestamptz')}, {array(generations, 'integer')})"
    )


def _passage(row: asyncpg.Record) -> PassageRow:
    return PassageRow(
        kb_ref=row["kb_ref"],
        doc_ref=row["doc_ref"],
        version=row["version"],
        chunk_index=row["chunk_index"],
        text=row["text"],
        start=row["start_offset"],
        end=row["end_offset"],
        heading_path=tuple(row["heading_path"]),
        location=location_from(row["location"]),
    )
