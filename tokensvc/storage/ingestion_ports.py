"""Background ingestion's port: an upload queued durably, and the leased work that turns it into a
searchable version (`tokensvc.knowledge.ingestion`). Re-exported by `tokensvc.storage.ports`,
whose common rules apply.

The queue holds at most one version per document: a newer upload replaces one still queued or
working (its lease ends with it), deleting the document or its base removes it. A version becomes
searchable in one step, `finish`: its chunks replace the previous version's in the same
transaction, so a search sees the old version or the new one, never a mix and never nothing.

Every call after `claim` names the runner and does nothing (None, False) when that runner does
not hold the ingestion's unexpired lease (taken over, replaced, deleted), so a runner that lost
it changes nothing; a batch of vectors and its progress commit together, so a runner killed
mid-batch leaves that batch to do again and nothing else.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

import numpy as np

from tokensvc.storage.ingestion_records import (
    Enqueued,
    Extracted,
    Ingestion,
    IngestionQueue,
    StagedChunk,
)
from tokensvc.storage.records import BaseRow, DocumentRow, Tenant

__all__ = ["IngestionStore"]


class IngestionStore(Protocol):
    """The ingestion queue: uploads in, leased work through, versions out (a `LeasedJobStore`)."""

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
        """Store an upload durably, under the document's lock. None when the base does not exist
        (or is outside `tenant`). `ingestion` is what makes the newest version searchable (None
        when it is READY already).

        - The same bytes as the version on its way in (queued or working, not FAILED): nothing
          new; a different `metadata` replaces its stored one. `unchanged`, with that ingestion.
        - Otherwise the same bytes as the READY version: nothing new; a different `metadata`
          replaces the stored one (its chunks' too), and a newer version queued, working or
          FAILED is dropped (the upload asks for the content that is searchable). `unchanged`,
          no ingestion.
        - Otherwise (new bytes, or those of a FAILED version): the next version, one above both
          the READY version and the one it replaces, PENDING, replacing any queued, working or
          FAILED one (a version dropped before is not remembered: its number may come again)."""
        ...

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> Ingestion | None:
        """Take the lease of a PENDING or PROCESSING ingestion whose lease is free or expired, or
        `runner`'s own, other than those in `busy`: of the namespace with the fewest ingestions
        leased now, the oldest first (one namespace's queue does not hold the others back)."""
        ...

    async def claim_one(self, job: Ingestion, runner: str, *, lease_seconds: float) -> Ingestion | None:
        """Take the lease of this ingestion (an upload that waits for its version runs it at
        once) when it is free, expired or `runner`'s; None when another runner holds it, or it
        ended (FAILED, finished, replaced, deleted)."""
        ...

    async def renew(self, job: Ingestion, runner: str, *, lease_seconds: float) -> bool:
        """Extend `runner`'s lease (an expired one too, when nobody took it since)."""
        ...

    async def record_failure(
        self, job: Ingestion, runner: str, reason: str, *, pause_after: int
    ) -> Ingestion | None:
        """Count a consecutive failure; at `pause_after` of them the ingestion is FAILED with
        `reason` (its lease released)."""
        ...

    async def content(self, job: Ingestion, runner: str) -> bytes | None:
        """The uploaded bytes."""
        ...

    async def store_extraction(self, job: Ingestion, runner: str, extracted: Extracted) -> Ingestion | None:
        """The extraction's text, spans, type and chunks (without vectors) replace any staged
        before: PROCESSING, `chunks_total` set, `chunks_done` 0, the failures reset."""
        ...

    async def unembedded(self, job: Ingestion, runner: str, *, limit: int) -> list[StagedChunk] | None:
        """Up to `limit` staged chunks without a vector yet, in chunk order."""
        ...

    async def store_vectors(
        self, job: Ingestion, runner: str, vectors: Sequence[tuple[StagedChunk, np.ndarray]]
    ) -> Ingestion | None:
        """Vectors for staged chunks (each named by its kind and index) and the progress
        (`chunks_done`) in one commit; a chunk embedded already keeps its vector (a batch written
        twice counts once); the failures reset."""
        ...

    async def finish(self, job: Ingestion, runner: str) -> DocumentRow | None:
        """Make the version searchable: under the document's lock its staged chunks replace the
        previous version's chunks, its text and spans become the document's, the ingestion ends.
        While the ingestion's `migration` still backfills, its target chunks are written for the
        base's next generation and the version counts as migrated; otherwise they are dropped and
        the version is not migrated (the migration embeds it in its next pass).
        Raises `StaleKnowledgeBases` when the base cut over to another generation since the
        chunks were staged: they are dropped and the ingestion is PENDING again (extracted and
        embedded anew for the new pins). None without the lease, before the extraction, or with a
        chunk unembedded; None too when the document has a version at least as new already (a
        synchronous `KnowledgeStore.replace_document` since): the ingestion ends, superseded."""
        ...

    async def fail(self, job: Ingestion, runner: str, reason: str) -> Ingestion | None:
        """End the ingestion FAILED with `reason` now (the content is refused: retrying would
        not help), its lease released; its staged chunks go, the record stays until a newer
        upload or a deletion. `record_failure` at `pause_after` ends it the same way."""
        ...

    async def discard(self, job: Ingestion, runner: str) -> bool:
        """Remove the ingestion and all it stored when `runner` holds its unexpired lease or it
        FAILED (an upload that waited for it and is told why it failed keeps nothing)."""
        ...

    async def get(self, job: Ingestion) -> Ingestion | None:
        """The ingestion as stored now (None once it finished, was replaced or deleted), as the
        runner reads its jobs."""
        ...

    async def base_of(self, job: Ingestion, runner: str) -> BaseRow | None:
        """The ingestion's knowledge base as it is pinned now (None: deleted, or the lease is not
        held)."""
        ...

    async def queue(self) -> IngestionQueue:
        """The queue across every namespace, for the metrics and the stuck-queue alert."""
        ...
