"""A knowledge base's backfill: every current document's chunks of the base's next generation,
re-chunked from the document's stored text when the migration changes the chunking, embedded by
the target and written whole, document by document."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from tokensvc.embedders import Demand, ScheduledEmbedder
from tokensvc.errors import EmbedderUnavailable
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import SpanIndex
from tokensvc.observability.metrics import METRICS
from tokensvc.reembedding.backfill import bulk_demand, embed_texts
from tokensvc.reembedding.pipeline import BatchPipeline
from tokensvc.storage.ports import KnowledgeBackfillStore
from tokensvc.storage.records import ChunkRow, StoredChunk
from tokensvc.storage.reembedding_records import KnowledgeBaseMigration, PendingDocument

__all__ = ["KnowledgeBackfill"]

_CLEAR_DOCUMENTS = 100  # documents per clean-up transaction (each with all its chunks)
# Documents read per batch (one transaction); their chunks are embedded in the embedder's batches.
_DOCUMENT_BATCH = 32

_Batch = list[tuple[PendingDocument, tuple[StoredChunk, ...]]]


class KnowledgeBackfill:
    """Documents in batches, each written whole with its chunks by `runner_id` (whose lease each
    write extends by `lease_seconds`)."""

    rows = "documents"
    clear_limit = _CLEAR_DOCUMENTS

    def __init__(self, store: KnowledgeBackfillStore, *, runner_id: str, lease_seconds: float):
        self._store = store
        self._runner_id = runner_id
        self._lease_seconds = lease_seconds

    async def backfill(
        self,
        migration: KnowledgeBaseMigration,
        embedder: ScheduledEmbedder,
        size: int,
        pipeline: BatchPipeline,
    ) -> None:
        demand = bulk_demand(migration)

        async def embed(batch: _Batch) -> list[np.ndarray]:
            return await _embed_spans(embedder, batch, size, demand)

        async def store(
            at: KnowledgeBaseMigration, batch: _Batch, vectors: list[np.ndarray]
        ) -> KnowledgeBaseMigration | None:
            stored = await self._store.store_documents(
                at,
                self._runner_id,
                _embedded_documents(batch, vectors),
                lease_seconds=self._lease_seconds,
            )
            if stored is not None:
                METRICS.migration_rows.labels(at.target.name).inc(len(vectors))
            return stored

        await pipeline.pipeline(
            migration,
            read=self._documents_after,
            ahead_of=lambda at, batch: replace(at, document_cursor=batch[-1][0].ref),
            embed=embed,
            store=store,
            unreadable="a document has no stored text to re-chunk; upload it again",
        )

    async def _documents_after(self, migration: KnowledgeBaseMigration) -> _Batch | None:
        """The next pending documents with their chunks under the target chunking; None when one
        cannot be re-chunked (no stored text: refused at the start, so only a replica that keeps
        no texts could have written it)."""
        documents = await self._store.pending_documents(migration, limit=_DOCUMENT_BATCH)
        if migration.rechunks and any(document.text is None for document in documents):
            return None
        return [(document, await _chunks_of(migration, document)) for document in documents]


async def _embed_spans(
    embedder: ScheduledEmbedder, batch: _Batch, size: int, demand: Demand
) -> list[np.ndarray]:
    texts = [chunk.text for _, chunks in batch for chunk in chunks]
    vectors: list[np.ndarray] = []
    for start in range(0, len(texts), size):
        vectors.extend(
            await embed_texts(embedder, texts[start : start + size], demand, span="reembedding.batch")
        )
    return vectors


async def _chunks_of(migration: KnowledgeBaseMigration, document: PendingDocument) -> tuple[StoredChunk, ...]:
    """The document's chunks under the target chunking: cut again from its stored text when the
    migration changes the chunking (in a thread: chunking a large text takes a while), else the
    chunks it has."""
    if not migration.rechunks:
        return document.chunks
    target = migration.target_chunking
    if document.text is None:
        # Refused at the start; a document from a replica that keeps no texts would be this.
        raise EmbedderUnavailable(
            f"document {document.ref!r} has no stored text to re-chunk; upload it again"
        )
    strategy = ChunkingStrategy.from_stored(target.kind, target.size, target.overlap)
    chunks = await asyncio.to_thread(chunk_document, document.text, strategy)
    where = SpanIndex(document.spans)  # each new chunk's page, slide or rows
    return tuple(
        StoredChunk(c.index, c.text, c.start, c.end, tuple(c.heading_path), where.locate(c.start, c.end))
        for c in chunks
    )


def _embedded_documents(
    batch: _Batch, vectors: list[np.ndarray]
) -> list[tuple[PendingDocument, list[ChunkRow]]]:
    """Each document with its chunks and their vectors (`vectors` in the batch's chunk order)."""
    rows: list[tuple[PendingDocument, list[ChunkRow]]] = []
    at = 0
    for document, chunks in batch:
        rows.append(
            (
                document,
                [
                    ChunkRow(c.index, c.text, c.start, c.end, c.heading_path, vectors[at + i], c.location)
                    for i, c in enumerate(chunks)
                ],
            )
        )
        at += len(chunks)
    return rows
