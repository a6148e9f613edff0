"""Background ingestion's records: a document version queued for extraction and embedding (a
leased job of `tokensvc.jobs`), its chunks as staged before they are embedded, and the queue as an
operator watches it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tokensvc.storage.records import NOWHERE, DocumentRow, DocumentState, Location, SourceSpan

__all__ = ["Enqueued", "Extracted", "Ingestion", "IngestionQueue", "IngestionState", "StagedChunk"]


class IngestionState(enum.StrEnum):
    """A queued version's state; once READY it is the document's row, and no ingestion any more."""

    PENDING = "pending"  # stored, not extracted yet (or extracted for a generation since cut over)
    PROCESSING = "processing"  # extracted: its chunks are being embedded
    FAILED = "failed"  # given up, with a reason; the previous version stays searchable


_DOCUMENT_STATES = {
    IngestionState.PENDING: DocumentState.PENDING,
    IngestionState.PROCESSING: DocumentState.PROCESSING,
    IngestionState.FAILED: DocumentState.FAILED,
}


@dataclass(frozen=True)
class Ingestion:
    """One document version on its way in; at most one per document (a newer upload replaces
    it). `generation` is the base generation its staged chunks were cut and embedded for (None
    until extracted), `migration` the base's backfilling migration whose target chunks are staged
    too (None: none); `chunks_total` (both kinds) is None until extracted."""

    id: str
    namespace: str
    kb_ref: str
    doc_ref: str
    version: int
    content_type: str
    content_sha256: bytes
    size_bytes: int
    metadata: dict[str, Any]
    state: IngestionState
    chunks_done: int
    chunks_total: int | None
    generation: int | None
    reason: str
    failures: int
    created_at: datetime
    updated_at: datetime
    migration: str | None = None

    @property
    def paused(self) -> bool:
        """A failed ingestion waits for nobody: it ended (`tokensvc.jobs.LeasedJob`)."""
        return self.state is IngestionState.FAILED

    def as_document(self, searchable_version: int | None) -> DocumentRow:
        """The document as a reader sees it while this is its newest version."""
        return DocumentRow(
            namespace=self.namespace,
            kb_ref=self.kb_ref,
            ref=self.doc_ref,
            version=self.version,
            content_type=self.content_type,
            content_sha256=self.content_sha256,
            size_bytes=self.size_bytes,
            chunk_count=self.chunks_total or 0,
            metadata=self.metadata,
            created_at=self.created_at,
            state=_DOCUMENT_STATES[self.state],
            chunks_done=self.chunks_done,
            failure_reason=self.reason if self.state is IngestionState.FAILED else "",
            searchable_version=searchable_version,
        )


@dataclass(frozen=True)
class StagedChunk:
    """A chunk of a version being ingested, as the extraction cut it, before its vector: for the
    base as it is pinned, or (`target`) for its backfilling migration's target."""

    index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...]
    location: Location = NOWHERE
    target: bool = False


@dataclass(frozen=True)
class Extracted:
    """What an ingestion's extraction stores: the text, where its spans come from in the original,
    the type the bytes were recognised as, and the chunks cut for the base's `generation` (and, for
    the backfilling `migration`, its target's)."""

    text: str
    spans: Sequence[SourceSpan]
    content_type: str
    chunks: Sequence[StagedChunk]
    generation: int
    migration: str | None = None


@dataclass(frozen=True)
class Enqueued:
    """An upload's outcome: the document as a reader now sees it, whether the upload changed
    nothing (the same content as the newest version), and the ingestion to run (None: nothing
    to extract, e.g. only the metadata changed)."""

    document: DocumentRow
    unchanged: bool
    ingestion: Ingestion | None


@dataclass(frozen=True)
class IngestionQueue:
    """The queue across every namespace: versions waiting, being worked on (leased now), failed,
    and how long the oldest unfinished one has waited since it was uploaded (0: none)."""

    pending: int
    processing: int
    failed: int
    oldest_seconds: float
