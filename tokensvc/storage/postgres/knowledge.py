"""Knowledge bases in PostgreSQL (the contract: `tokensvc.storage.ports.KnowledgeStore`).

A new document version is written in one transaction (the new chunks inserted, the old version's
deleted), serialised per document by a transaction-scoped advisory lock; foreign keys cascade
deletes to documents and chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg
from pgvector import Vector

from tokensvc.storage.filters import Filter
from tokensvc.storage.ports import StaleKnowledgeBases
from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.filters import compile_filter
from tokensvc.storage.postgres.ranking import (
    Corpus,
    candidates_from,
    fetch_candidates,
)
from tokensvc.storage.postgres.tenant import literal, tenant_transaction
from tokensvc.storage.records import (
    BaseRow,
    ChunkRow,
    DocumentRow,
    KnowledgePins,
    PassageRow,
    SearchOutcome,
    SearchPlan,
    Tenant,
)

__all__ = ["PostgresKnowledgeStore"]


# A chunk's neighbours are the chunks before and after it in the same document version.
_CORPUS = Corpus(
    table="chunks",
    partition=("namespace", "kb_ref", "doc_ref", "version"),
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
    ),
)


_BASE_COLUMNS = (
    "namespace, ref, display_name, embedder, model, dimension, normalized, chunking, chunk_size, "
    "chunk_overlap, text_config, created_at"
)
# Reads cast the regconfig to its name.
_BASE_SELECT = _BASE_COLUMNS.replace("text_config", "text_config::text AS text_config")
_DOC_COLUMNS = "namespace, kb_ref, ref, version, content_type, content_sha256, size_bytes, chunk_count, metadata, created_at"
_DOC_FIELDS = tuple(_DOC_COLUMNS.split(", "))
_BASE_FIELDS = (*_BASE_COLUMNS.split(", "), "document_count")
_BASE_QUALIFIED = ", ".join(
    f"b.{c}::text AS {c}" if c == "text_config" else f"b.{c}" for c in _BASE_COLUMNS.split(", ")
)


_INSERT_CHUNKS = """
    INSERT INTO chunks (namespace, kb_ref, doc_ref, version, chunk_index, text, start_offset,
                        end_offset, heading_path, metadata, dimension, embedding, text_config)
    SELECT $1, $2, $3, $4, u.idx, u.text, u.start_offset, u.end_offset,
           ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), $9, $10, u.embedding,
           -- The corpus's pinned configuration, read here so no writer can differ.
           (SELECT b.text_config FROM knowledge_bases b WHERE b.namespace = $1 AND b.ref = $2)
    FROM unnest($11::int[], $12::text[], $13::int[], $14::int[], $15::text[], $16::vector[])
         AS u(idx, text, start_offset, end_offset, heading, embedding)
"""


def _base(row: asyncpg.Record) -> BaseRow:
    return BaseRow(**dict(row.items()))


def _document(row: asyncpg.Record | dict[str, Any]) -> DocumentRow:
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
                f"INSERT INTO knowledge_bases ({_BASE_COLUMNS}) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::regconfig, now()) "
                f"ON CONFLICT (namespace, ref) DO NOTHING RETURNING {_BASE_SELECT}",
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
                created = _base(inserted)
            else:
                existing = await conn.fetchrow(
                    f"SELECT {_BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                    "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                    "WHERE namespace = $1 AND ref = $2",
                    base.namespace,
                    base.ref,
                )
                assert existing is not None
                return _base(existing), False
        async with self._pool.acquire() as conn:
            await conn.execute("SELECT ensure_chunk_vector_index($1)", created.dimension)
        return created, True

    async def get_bases(self, tenant: Tenant, refs: Sequence[str]) -> list[BaseRow]:
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {_BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                "WHERE namespace = $1 AND ref = ANY($2::text[]) ORDER BY ref",
                tenant.namespace,
                list(refs),
            )
        return [_base(row) for row in rows]

    async def list_bases(self, tenant: Tenant, *, after: str | None, limit: int) -> list[BaseRow]:
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                f"SELECT {_BASE_SELECT}, (SELECT count(*) FROM documents d WHERE d.namespace = b.namespace "
                "AND d.kb_ref = b.ref) AS document_count FROM knowledge_bases b "
                "WHERE namespace = $1 AND ref > $2 ORDER BY ref LIMIT $3",
                tenant.namespace,
                after or "",
                limit,
            )
        return [_base(row) for row in rows]

    async def delete_base(self, tenant: Tenant, ref: str) -> int | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            # RETURNING reads the statement's snapshot: the documents the cascade deletes.
            count = await conn.fetchval(
                "DELETE FROM knowledge_bases b WHERE namespace = $1 AND ref = $2 RETURNING (SELECT count(*) "
                "FROM documents d WHERE d.namespace = b.namespace AND d.kb_ref = b.ref)",
                tenant.namespace,
                ref,
            )
        return None if count is None else int(count)

    # --- documents --------------------------------------------------------------------------

    async def document_state(
        self, tenant: Tenant, kb_ref: str, doc_ref: str
    ) -> tuple[BaseRow | None, DocumentRow | None]:
        async with tenant_transaction(self._pool, tenant) as conn:
            row = await conn.fetchrow(
                f"SELECT {_BASE_QUALIFIED}, 0::bigint AS document_count, "
                f"{', '.join(f'd.{c} AS d_{c}' for c in _DOC_FIELDS)} FROM knowledge_bases b "
                "LEFT JOIN documents d ON d.namespace = b.namespace AND d.kb_ref = b.ref AND d.ref = $3 "
                "WHERE b.namespace = $1 AND b.ref = $2",
                tenant.namespace,
                kb_ref,
                doc_ref,
            )
        if row is None:
            return None, None
        base = BaseRow(**{name: row[name] for name in _BASE_FIELDS})
        document = None if row["d_ref"] is None else _document({c: row[f"d_{c}"] for c in _DOC_FIELDS})
        return base, document

    async def list_documents(
        self, tenant: Tenant, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow] | None:
        params: list[Any] = [tenant.namespace, kb_ref, after or "", limit]
        where = "namespace = b.namespace AND kb_ref = b.ref AND ref > $3"
        if filter_ is not None:
            where += f" AND ({compile_filter(filter_, 'metadata', params)})"
        async with tenant_transaction(self._pool, tenant) as conn:
            # No row: no such base; one row of NULLs: a base without (matching) documents.
            rows = await conn.fetch(
                f"SELECT d.* FROM knowledge_bases b LEFT JOIN LATERAL (SELECT {_DOC_COLUMNS} FROM documents "
                f"WHERE {where} ORDER BY ref LIMIT $4) d ON true WHERE b.namespace = $1 AND b.ref = $2",
                *params,
            )
        if not rows:
            return None
        return [_document(row) for row in rows if row["ref"] is not None]

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
    ) -> tuple[DocumentRow, bool] | None:
        """One transaction under the document's advisory lock (contract: the port's): the lock
        with the transaction's start, the current version read under it, then one write."""
        ns = tenant.namespace
        keys = (ns, kb_ref, ref)
        # Serialise writers of the same document; the first writer creates the row.
        async with tenant_transaction(self._pool, tenant, lock=f"{ns}/{kb_ref}/{ref}") as conn:
            stored = await conn.fetchrow(
                "SELECT version, content_sha256 FROM documents WHERE namespace = $1 AND kb_ref = $2 AND ref = $3",
                *keys,
            )
            if stored is not None and stored["content_sha256"] == content_sha256:
                row = await conn.fetchrow(
                    "WITH doc AS (UPDATE documents SET metadata = $4, updated_at = clock_timestamp() "
                    f"WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING {_DOC_COLUMNS}), "
                    "swept AS (UPDATE chunks SET metadata = $4 WHERE namespace = $1 AND kb_ref = $2 "
                    "AND doc_ref = $3) SELECT * FROM doc",
                    *keys,
                    metadata,
                )
                assert row is not None
                return _document(row), False
            if chunks is None:
                return None  # the content changed meanwhile: the caller chunks the new one
            version = 1 if stored is None else stored["version"] + 1
            if stored is None:
                document = (
                    f"INSERT INTO documents ({_DOC_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, "
                    f"clock_timestamp()) RETURNING {_DOC_COLUMNS}"
                )
                old_chunks = ""
            else:
                document = (
                    "UPDATE documents SET version = $4, content_type = $5, content_sha256 = $6, size_bytes = $7, "
                    "chunk_count = $8, metadata = $9, updated_at = clock_timestamp() "
                    f"WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING {_DOC_COLUMNS}"
                )
                old_chunks = (
                    ", gone AS (DELETE FROM chunks WHERE namespace = $1 AND kb_ref = $2 AND doc_ref = $3 "
                    "AND version < $4)"
                )
            # One statement: the document row, the old version's chunks gone, the new ones in (the
            # foreign key is checked at the statement's end, when the document row exists).
            row = await conn.fetchrow(
                f"WITH doc AS ({document}){old_chunks}, added AS ({_INSERT_CHUNKS}) SELECT * FROM doc",
                *keys,
                version,
                content_type,
                content_sha256,
                size_bytes,
                len(chunks),
                metadata,
                max((int(c.embedding.shape[0]) for c in chunks[:1]), default=1),
                [c.index for c in chunks],
                [c.text for c in chunks],
                [c.start for c in chunks],
                [c.end for c in chunks],
                # JSON text per chunk: asyncpg would read a list of lists as a 2-D array.
                [json.dumps(list(c.heading_path)) for c in chunks],
                [Vector(c.embedding) for c in chunks],
            )
        assert row is not None
        return _document(row), True

    async def delete_document(self, tenant: Tenant, kb_ref: str, ref: str) -> int | None:
        async with tenant_transaction(self._pool, tenant) as conn:
            count = await conn.fetchval(
                "DELETE FROM documents WHERE namespace = $1 AND kb_ref = $2 AND ref = $3 RETURNING chunk_count",
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
        row_count: int | None,
        count_cap: int,
        filter_: Filter | None,
        expect: KnowledgePins | None = None,
    ) -> SearchOutcome[PassageRow]:
        def where(params: list[Any], searchable: bool) -> str:
            params += [tenant.namespace, list(kb_refs)]
            predicate = "namespace = $1 AND kb_ref = ANY($2::text[])"
            if searchable and filter_ is not None:
                predicate += f" AND ({compile_filter(filter_, 'metadata', params)})"
            return predicate

        try:
            rows, found = await fetch_candidates(
                self._pool,
                tenant,
                _CORPUS,
                plan,
                where,
                row_count=row_count,
                count_cap=count_cap,
                checks=() if expect is None else (_expectation(expect),),
            )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _STALE_PINS:
                raise StaleKnowledgeBases() from None
            raise
        return SearchOutcome(rows, candidates_from(found, _passage))


_STALE_PINS = "TS001"  # raised by tokensvc.expect_knowledge_bases (migration 0010)


def _expectation(expect: KnowledgePins) -> str:
    def array(values: list[str], kind: str) -> str:
        return f"ARRAY[{', '.join(literal(v) for v in values)}]::{kind}[]"

    refs = [ref for ref, _ in expect.created]
    created = [moment.isoformat() for _, moment in expect.created]
    return (
        f"SELECT expect_knowledge_bases({array(list(expect.roster), 'text')}, {array(refs, 'text')}, "
        f"{array(created, 'timestamptz')})"
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
    )
