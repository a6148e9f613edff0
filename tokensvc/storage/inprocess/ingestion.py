"""Background ingestion in process memory (the contract:
`tokensvc.storage.ingestion_ports.IngestionStore`), over the tables of one
`InProcessKnowledgeStore` (`KnowledgeTables`: shared state, as PostgreSQL's tables are shared by
its stores).

The same semantics as `tokensvc.storage.postgres.ingestion`, checked by the conformance suite:
at most one version per document on its way in (`KnowledgeTables.ingestions`), leases that expire
by the store's clock, every write after the claim fenced by the runner's unexpired lease, and the
version's swap into `KnowledgeTables.documents` in one step. Writers hold the tables' lock from
their first read to their last write, across a scheduling point where PostgreSQL would take a
round trip; reads never yield, so each sees one state.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from tokensvc.storage.ingestion_records import (
    Enqueued,
    Extracted,
    Ingestion,
    IngestionQueue,
    IngestionState,
    StagedChunk,
)
from tokensvc.storage.inprocess.knowledge import (
    DocumentVersion,
    InProcessKnowledgeStore,
    KnowledgeTables,
    QueuedVersion,
    stored_chunk,
)
from tokensvc.storage.ports import StaleKnowledgeBases
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, BaseRow, ChunkRow, DocumentRow, Tenant

__all__ = ["InProcessIngestionStore"]

_DocKey = tuple[str, str, str]  # namespace, kb_ref, ref


async def _round_trip() -> None:
    """Where PostgreSQL would wait for the database: other tasks may run here."""
    await asyncio.sleep(0)


def _key(job: Ingestion) -> _DocKey:
    return job.namespace, job.kb_ref, job.doc_ref


def _visible(tenant: Tenant, kb_ref: str) -> bool:
    roster = tuple(tenant.knowledge_bases)
    return roster == (ALL_KNOWLEDGE_BASES,) or kb_ref in roster


def _stored_vector(vector: np.ndarray) -> np.ndarray:
    stored = np.array(vector, dtype=np.float32)
    stored.setflags(write=False)
    return stored


class InProcessIngestionStore:
    """`IngestionStore` over the knowledge store's tables (`knowledge.tables`, or a table set of
    its own), whose clock times the leases."""

    def __init__(self, knowledge: InProcessKnowledgeStore | KnowledgeTables | None = None):
        if isinstance(knowledge, InProcessKnowledgeStore):
            knowledge = knowledge.tables
        self.tables = knowledge if knowledge is not None else InProcessKnowledgeStore().tables

    def _now(self) -> datetime:
        return self.tables.clock.now()

    def _stored(self, job: Ingestion) -> QueuedVersion | None:
        """The ingestion `job` names, as stored (None once it ended, was replaced or deleted)."""
        queued = self.tables.ingestions.get(_key(job))
        return queued if queued is not None and queued.ingestion.id == job.id else None

    def _held(self, job: Ingestion, runner: str) -> QueuedVersion | None:
        """The ingestion, when `runner` holds its unexpired lease."""
        queued = self._stored(job)
        if (
            queued is None
            or queued.lease_owner != runner
            or queued.lease_until is None
            or queued.lease_until < self._now()
        ):
            return None
        return queued

    def _save(self, queued: QueuedVersion, **changes: Any) -> Ingestion:
        """Store `queued` with `changes` to its ingestion (and `updated_at` now)."""
        ingestion = (
            replace(queued.ingestion, **changes, updated_at=self._now()) if changes else queued.ingestion
        )
        self.tables.ingestions[_key(ingestion)] = replace(queued, ingestion=ingestion)
        return ingestion

    def _leased(self, queued: QueuedVersion, runner: str, lease_seconds: float) -> Ingestion:
        self.tables.ingestions[_key(queued.ingestion)] = replace(
            queued, lease_owner=runner, lease_until=self._now() + timedelta(seconds=lease_seconds)
        )
        return queued.ingestion

    def _claimable(self, queued: QueuedVersion, runner: str, now: datetime) -> bool:
        return queued.ingestion.state is not IngestionState.FAILED and (
            queued.lease_owner in (None, runner) or queued.lease_until is None or queued.lease_until < now
        )

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
        key = (tenant.namespace, kb_ref, ref)
        async with self.tables.lock:
            if (tenant.namespace, kb_ref) not in self.tables.bases or not _visible(tenant, kb_ref):
                return None
            stored = self.tables.documents.get(key)
            queued = self.tables.ingestions.get(key)
            await _round_trip()
            searchable = None if stored is None else stored.document.version
            if (
                queued is not None
                and queued.ingestion.state is not IngestionState.FAILED
                and queued.ingestion.content_sha256 == content_sha256
            ):
                ingestion = queued.ingestion
                if ingestion.metadata != metadata:
                    ingestion = self._save(queued, metadata=dict(metadata))
                return Enqueued(ingestion.as_document(searchable), unchanged=True, ingestion=ingestion)
            if stored is not None and stored.document.content_sha256 == content_sha256:
                # The searchable version is what this upload asks for: a newer queued one goes.
                self.tables.ingestions.pop(key, None)
                document = replace(stored.document, metadata=dict(metadata))
                self.tables.documents[key] = replace(stored, document=document)
                return Enqueued(_copy(document), unchanged=True, ingestion=None)
            now = self._now()
            created = Ingestion(
                id=str(uuid.uuid4()),
                namespace=tenant.namespace,
                kb_ref=kb_ref,
                doc_ref=ref,
                version=max(searchable or 0, 0 if queued is None else queued.ingestion.version) + 1,
                content_type=content_type,
                content_sha256=content_sha256,
                size_bytes=size_bytes,
                metadata=dict(metadata),
                state=IngestionState.PENDING,
                chunks_done=0,
                chunks_total=None,
                generation=None,
                reason="",
                failures=0,
                created_at=now,
                updated_at=now,
            )
            self.tables.ingestions[key] = QueuedVersion(created, bytes(content))
            return Enqueued(created.as_document(searchable), unchanged=False, ingestion=created)

    # --- the runner's lease -----------------------------------------------------------------

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> Ingestion | None:
        async with self.tables.lock:
            await _round_trip()
            now = self._now()
            unfinished = [
                q for q in self.tables.ingestions.values() if q.ingestion.state is not IngestionState.FAILED
            ]
            leased = Counter(
                q.ingestion.namespace
                for q in unfinished
                if q.lease_until is not None and q.lease_until >= now
            )
            candidates = sorted(
                (q for q in unfinished if self._claimable(q, runner, now) and q.ingestion.id not in busy),
                key=lambda q: (leased[q.ingestion.namespace], q.ingestion.created_at, q.ingestion.id),
            )
            return self._leased(candidates[0], runner, lease_seconds) if candidates else None

    async def claim_one(self, job: Ingestion, runner: str, *, lease_seconds: float) -> Ingestion | None:
        async with self.tables.lock:
            await _round_trip()
            queued = self._stored(job)
            if queued is None or not self._claimable(queued, runner, self._now()):
                return None
            return self._leased(queued, runner, lease_seconds)

    async def renew(self, job: Ingestion, runner: str, *, lease_seconds: float) -> bool:
        async with self.tables.lock:
            await _round_trip()
            queued = self._stored(job)
            if (
                queued is None
                or queued.lease_owner != runner
                or queued.ingestion.state is IngestionState.FAILED
            ):
                return False
            self._leased(queued, runner, lease_seconds)
            return True

    async def record_failure(
        self, job: Ingestion, runner: str, reason: str, *, pause_after: int
    ) -> Ingestion | None:
        async with self.tables.lock:
            queued = self._held(job, runner)
            await _round_trip()
            if queued is None:
                return None
            failures = queued.ingestion.failures + 1
            if failures < pause_after:
                return self._save(queued, failures=failures, reason=reason)
            return self._failed(queued, reason, failures=failures)

    def _failed(self, queued: QueuedVersion, reason: str, *, failures: int) -> Ingestion:
        """FAILED with `reason`: the lease released, the staged chunks gone."""
        ended = replace(queued, lease_owner=None, lease_until=None, staged={})
        return self._save(ended, state=IngestionState.FAILED, reason=reason, failures=failures)

    # --- the runner's work ------------------------------------------------------------------

    async def content(self, job: Ingestion, runner: str) -> bytes | None:
        queued = self._held(job, runner)
        return None if queued is None else queued.content

    async def store_extraction(self, job: Ingestion, runner: str, extracted: Extracted) -> Ingestion | None:
        async with self.tables.lock:
            queued = self._held(job, runner)
            await _round_trip()
            if queued is None:
                return None
            staged = replace(
                queued,
                text=extracted.text,
                spans=tuple(extracted.spans),
                media_type=extracted.content_type,
                staged={(c.target, c.index): (c, None) for c in extracted.chunks},
            )
            return self._save(
                staged,
                state=IngestionState.PROCESSING,
                chunks_total=len(extracted.chunks),
                chunks_done=0,
                generation=extracted.generation,
                migration=extracted.migration,
                failures=0,
                reason="",
            )

    async def unembedded(self, job: Ingestion, runner: str, *, limit: int) -> list[StagedChunk] | None:
        queued = self._held(job, runner)
        if queued is None:
            return None
        waiting = sorted(key for key, (_, vector) in queued.staged.items() if vector is None)
        return [queued.staged[key][0] for key in waiting[:limit]]

    async def store_vectors(
        self, job: Ingestion, runner: str, vectors: Sequence[tuple[StagedChunk, np.ndarray]]
    ) -> Ingestion | None:
        async with self.tables.lock:
            queued = self._held(job, runner)
            await _round_trip()
            if queued is None:
                return None
            staged = dict(queued.staged)
            written = 0
            # Each chunk once: a batch written again (a retry after a lost reply) changes nothing.
            for chunk, vector in vectors:
                key = (chunk.target, chunk.index)
                if key in staged and staged[key][1] is None:
                    staged[key] = (staged[key][0], _stored_vector(vector))
                    written += 1
            return self._save(
                replace(queued, staged=staged),
                chunks_done=queued.ingestion.chunks_done + written,
                failures=0,
                reason="",
            )

    async def finish(self, job: Ingestion, runner: str) -> DocumentRow | None:
        async with self.tables.lock:
            queued = self._held(job, runner)
            await _round_trip()
            if queued is None:
                return None
            held = queued.ingestion
            if held.generation is None or held.chunks_total is None:
                return None  # not extracted yet
            current = self.tables.documents.get(_key(held))
            if current is not None and current.document.version >= held.version:
                # A synchronous upload (`replace_document`) wrote a version at least as new.
                del self.tables.ingestions[_key(held)]
                return None
            base = self.tables.bases.get((held.namespace, held.kb_ref))
            assert base is not None  # deleting the base deleted its ingestions
            migrating = self.tables.migrating.get((held.namespace, held.kb_ref))
            target_dimension = (
                migrating[1].dimension if migrating is not None and migrating[0] == held.migration else None
            )
            foreign = any(
                vector is not None
                and (target_dimension is not None or not target)
                and len(vector) != (target_dimension if target else base.dimension)
                for (target, _), (_, vector) in queued.staged.items()
            )
            if base.generation != held.generation or foreign:
                # Cut over since the chunks were staged (they are the old pins'), or a vector is
                # of other pins than its generation's (embedded by a turn of before). Start again.
                self._save(
                    replace(queued, staged={}),
                    state=IngestionState.PENDING,
                    generation=None,
                    migration=None,
                    chunks_total=None,
                    chunks_done=0,
                )
                raise StaleKnowledgeBases()
            if any(vector is None for _, vector in queued.staged.values()):
                return None
            return self._swap_version(queued)

    def _swap_version(self, queued: QueuedVersion) -> DocumentRow:
        """The version becomes the document's: its chunks replace the previous version's (of
        every generation), its text and spans the document's, and the ingestion ends. Its target
        chunks are the next generation's while its migration still backfills (the version is then
        migrated already), else dropped."""
        held = queued.ingestion
        assert held.generation is not None
        key = _key(held)
        previous = self.tables.documents.get(key)
        migrating = self.tables.migrating.get((held.namespace, held.kb_ref))
        dual = held.migration is not None and migrating is not None and migrating[0] == held.migration
        own = [(c, v) for (target, _), (c, v) in sorted(queued.staged.items()) if not target]
        document = DocumentRow(
            namespace=held.namespace,
            kb_ref=held.kb_ref,
            ref=held.doc_ref,
            version=held.version,
            content_type=queued.media_type or held.content_type,
            content_sha256=held.content_sha256,
            size_bytes=held.size_bytes,
            chunk_count=len(own),
            metadata=dict(held.metadata),
            # The document's creation: its first version's (an update keeps it).
            created_at=self._now() if previous is None else previous.document.created_at,
        )

        def stored(target: bool) -> tuple[Any, ...]:
            return tuple(
                stored_chunk(
                    document, ChunkRow(c.index, c.text, c.start, c.end, c.heading_path, v, c.location)
                )
                for (is_target, _), (c, v) in sorted(queued.staged.items())
                if is_target == target and v is not None
            )

        chunks = {held.generation: stored(False)}
        migrated = None
        if dual:
            chunks[held.generation + 1] = stored(True)
            migrated = len(chunks[held.generation + 1])
        # Without target chunks not migrated yet: a running migration embeds it in its next pass.
        self.tables.documents[key] = DocumentVersion(document, chunks, queued.text, migrated, queued.spans)
        del self.tables.ingestions[key]
        return _copy(document)

    async def fail(self, job: Ingestion, runner: str, reason: str) -> Ingestion | None:
        async with self.tables.lock:
            queued = self._held(job, runner)
            await _round_trip()
            if queued is None:
                return None
            return self._failed(queued, reason, failures=queued.ingestion.failures)

    async def discard(self, job: Ingestion, runner: str) -> bool:
        async with self.tables.lock:
            queued = self._stored(job)
            await _round_trip()
            if queued is None or (
                queued.ingestion.state is not IngestionState.FAILED and self._held(job, runner) is None
            ):
                return False
            del self.tables.ingestions[_key(job)]
            return True

    # --- reads ------------------------------------------------------------------------------

    async def get(self, job: Ingestion) -> Ingestion | None:
        queued = self._stored(job)
        return None if queued is None else queued.ingestion

    async def base_of(self, job: Ingestion, runner: str) -> BaseRow | None:
        base = self.tables.bases.get((job.namespace, job.kb_ref))
        if base is None or self._held(job, runner) is None:
            return None
        base = replace(base, document_count=0)
        migrating = self.tables.migrating.get((job.namespace, job.kb_ref))
        if migrating is None:
            return base
        return replace(
            base, migration_id=migrating[0], migrating_to=migrating[1], migrating_chunking=migrating[2]
        )

    async def queue(self) -> IngestionQueue:
        now = self._now()
        pending = processing = failed = 0
        oldest: datetime | None = None
        for queued in self.tables.ingestions.values():
            ingestion = queued.ingestion
            if ingestion.state is IngestionState.FAILED:
                failed += 1
                continue
            if queued.lease_until is not None and queued.lease_until >= now:
                processing += 1
            else:
                pending += 1
            oldest = ingestion.created_at if oldest is None else min(oldest, ingestion.created_at)
        waited = 0.0 if oldest is None else (now - oldest).total_seconds()
        return IngestionQueue(pending, processing, failed, waited)


def _copy(document: DocumentRow) -> DocumentRow:
    return replace(document, metadata=dict(document.metadata))
