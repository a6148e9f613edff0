"""Knowledge bases in process memory (the contract: `tokensvc.storage.ports.KnowledgeStore`).

The same semantics as `tokensvc.storage.postgres.knowledge`, checked by the conformance suite: a
tenant sees its namespace's knowledge bases in its roster (`("*",)` alone: all of them), and
writing outside it raises `PermissionError` (row-level security refuses in PostgreSQL); a
document's current version and its chunks are swapped in one step, so a reader sees exactly one
version; deleting a base or a document deletes what belongs to it. Searching is
`tokensvc.storage.inprocess.ranking`'s (always exact, `simple` words).

Writers hold the store's lock from their first read to their last write, across a scheduling
point where PostgreSQL would take a round trip (its per-document advisory lock serialises the
same writers); reads never yield, so each sees one state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import numpy as np

from tokensvc.storage.filter_language import Filter, matches
from tokensvc.storage.ingestion_records import Ingestion, StagedChunk
from tokensvc.storage.inprocess.clock import Clock, StoreClock
from tokensvc.storage.inprocess.ranking import Searchable, candidates
from tokensvc.storage.inprocess.text import Terms, terms_of
from tokensvc.storage.ports import StaleKnowledgeBases
from tokensvc.storage.records import (
    ALL_KNOWLEDGE_BASES,
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
    "DocumentVersion",
    "InProcessKnowledgeStore",
    "KnowledgeTables",
    "QueuedVersion",
    "stored_chunk",
]

_DocKey = tuple[str, str, str]  # namespace, kb_ref, ref


@dataclass(frozen=True)
class _Chunk:
    passage: PassageRow
    embedding: np.ndarray
    terms: Terms


@dataclass(frozen=True)
class DocumentVersion:
    """A document's current version with its chunks by generation: replaced whole, never edited
    in place. `migrated_chunk_count` is set when the next generation's chunks of this version
    are written (PostgreSQL's `migrated_version` equal to `version`)."""

    document: DocumentRow
    chunks: Mapping[int, tuple[_Chunk, ...]]
    text: str | None = None
    migrated_chunk_count: int | None = None
    spans: tuple[SourceSpan, ...] = ()


@dataclass(frozen=True)
class QueuedVersion:
    """A document's version on its way in (`tokensvc.storage.inprocess.ingestion`): the
    ingestion as a reader sees it, its lease, the uploaded bytes, what the extraction stored
    (text, spans, the recognised type) and the staged chunks by (target, index), each with its
    vector once embedded. Replaced whole, never edited in place."""

    ingestion: Ingestion
    content: bytes
    lease_owner: str | None = None
    lease_until: datetime | None = None
    text: str | None = None
    spans: tuple[SourceSpan, ...] = ()
    media_type: str | None = None
    staged: Mapping[tuple[bool, int], tuple[StagedChunk, np.ndarray | None]] = field(default_factory=dict)


def _visible(tenant: Tenant, namespace: str, kb_ref: str) -> bool:
    # As the policies read `tokensvc.kbs`: '*' only when it is the whole roster.
    roster = tuple(tenant.knowledge_bases)
    return namespace == tenant.namespace and (roster == (ALL_KNOWLEDGE_BASES,) or kb_ref in roster)


def _check_writable(tenant: Tenant, namespace: str, kb_ref: str) -> None:
    if not _visible(tenant, namespace, kb_ref):
        raise PermissionError("the knowledge base is outside the tenant's namespace or roster")


async def _round_trip() -> None:
    """Where PostgreSQL would wait for the database: other tasks may run here."""
    await asyncio.sleep(0)


@dataclass
class KnowledgeTables:
    """The knowledge bases' tables, shared by every in-process store that reads or writes them
    (this module's, the re-embedding store) under one lock, as PostgreSQL's tables are."""

    clock: StoreClock
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bases: dict[tuple[str, str], BaseRow] = field(default_factory=dict)
    documents: dict[_DocKey, DocumentVersion] = field(default_factory=dict)
    # Kept by the ingestion store: each document's version on its way in, at most one.
    ingestions: dict[_DocKey, QueuedVersion] = field(default_factory=dict)
    # Kept by the re-embedding store: each base's backfilling migration (id, target, chunking),
    # and who is told when a base is deleted (its migrations end, as PostgreSQL's function does).
    migrating: dict[tuple[str, str], tuple[str, EmbedderSpec, ChunkingSpec]] = field(default_factory=dict)
    base_deleted: list[Callable[[str, str], None]] = field(default_factory=list)


class InProcessKnowledgeStore:
    """`KnowledgeStore` over dictionaries; `clock` is the wall clock."""

    def __init__(self, clock: Clock | None = None):
        self.tables = KnowledgeTables(StoreClock(clock))

    def _count(self, namespace: str, ref: str) -> int:
        return sum(1 for ns, kb, _ in self.tables.documents if (ns, kb) == (namespace, ref))

    def _base(self, tenant: Tenant, ref: str, *, counted: bool = True) -> BaseRow | None:
        base = self.tables.bases.get((tenant.namespace, ref))
        if base is None or not _visible(tenant, tenant.namespace, ref):
            return None
        return replace(base, document_count=self._count(tenant.namespace, ref) if counted else 0)

    # --- knowledge bases --------------------------------------------------------------------

    async def create_base(self, tenant: Tenant, base: BaseRow) -> tuple[BaseRow, bool]:
        _check_writable(tenant, base.namespace, base.ref)
        async with self.tables.lock:
            stored = self._base(tenant, base.ref)
            if stored is not None:
                return stored, False
            await _round_trip()
            created = replace(base, created_at=self.tables.clock.now(), document_count=0)
            self.tables.bases[(base.namespace, base.ref)] = created
            return created, True

    async def get_bases(self, tenant: Tenant, refs: Sequence[str]) -> list[BaseRow]:
        found = (self._base(tenant, ref) for ref in sorted(set(refs)))
        return [base for base in found if base is not None]

    async def bases_for_search(
        self, tenant: Tenant, refs: Sequence[str]
    ) -> tuple[list[BaseRow], KnowledgePins | None]:
        return await self.get_bases(tenant, refs), None  # read now: nothing for the search to check

    async def list_bases(self, tenant: Tenant, *, after: str | None, limit: int) -> list[BaseRow]:
        refs = sorted(ref for ns, ref in self.tables.bases if ns == tenant.namespace and ref > (after or ""))
        found = (self._base(tenant, ref) for ref in refs)
        return [base for base in found if base is not None][:limit]

    async def delete_base(self, tenant: Tenant, ref: str) -> int | None:
        async with self.tables.lock:
            base = self._base(tenant, ref)
            if base is None:
                return None
            del self.tables.bases[(tenant.namespace, ref)]
            # Its documents, and those only on their way in: the versions queued go too.
            gone = {k for k in self.tables.documents if k[:2] == (tenant.namespace, ref)}
            gone |= {k for k in self.tables.ingestions if k[:2] == (tenant.namespace, ref)}
            for key in gone:
                self.tables.documents.pop(key, None)
                self.tables.ingestions.pop(key, None)
            for listener in self.tables.base_deleted:
                listener(tenant.namespace, ref)
            return len(gone)

    # --- documents --------------------------------------------------------------------------

    def _current(self, tenant: Tenant, kb_ref: str, ref: str) -> DocumentVersion | None:
        if not _visible(tenant, tenant.namespace, kb_ref):
            return None
        return self.tables.documents.get((tenant.namespace, kb_ref, ref))

    async def document_text(self, tenant: Tenant, kb_ref: str, doc_ref: str, version: int) -> str | None:
        current = (
            self._current(tenant, kb_ref, doc_ref) if _visible(tenant, tenant.namespace, kb_ref) else None
        )
        if current is None or current.document.version != version:
            return None
        return current.text or ""

    async def document_state(
        self, tenant: Tenant, kb_ref: str, doc_ref: str
    ) -> tuple[BaseRow | None, DocumentRow | None]:
        """The base comes without its document count (0), as PostgreSQL's snapshot reads it."""
        base = self._base(tenant, kb_ref, counted=False)
        migrating = self.tables.migrating.get((tenant.namespace, kb_ref))
        if base is not None and migrating is not None:
            base = replace(
                base, migration_id=migrating[0], migrating_to=migrating[1], migrating_chunking=migrating[2]
            )
        return base, None if base is None else self._newest(tenant.namespace, kb_ref, doc_ref)

    def _newest(self, namespace: str, kb_ref: str, ref: str) -> DocumentRow | None:
        """The document's newest version as a reader sees it: the one on its way in, if any
        (with the version a search reads meanwhile), else the current one."""
        current = self.tables.documents.get((namespace, kb_ref, ref))
        queued = self.tables.ingestions.get((namespace, kb_ref, ref))
        if queued is not None:
            document = queued.ingestion.as_document(None if current is None else current.document.version)
            return _copy(document)
        return None if current is None else _copy(current.document)

    async def list_documents(
        self, tenant: Tenant, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow] | None:
        if self._base(tenant, kb_ref, counted=False) is None:
            return None
        # Every document with a version, searchable or on its way in; each its newest version's.
        refs = sorted(
            {
                ref
                for table in (self.tables.documents, self.tables.ingestions)
                for ns, kb, ref in table
                if (ns, kb) == (tenant.namespace, kb_ref) and ref > (after or "")
            }
        )
        newest = (self._newest(tenant.namespace, kb_ref, ref) for ref in refs)
        wanted = (d for d in newest if d is not None and (filter_ is None or matches(filter_, d.metadata)))
        return list(wanted)[:limit]

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
        """Serialised with every other writer (the contract asks: writers of the same document)."""
        _check_writable(tenant, tenant.namespace, kb_ref)
        key = (tenant.namespace, kb_ref, ref)
        async with self.tables.lock:
            stored = self.tables.documents.get(key)
            await _round_trip()
            if stored is not None and stored.document.content_sha256 == content_sha256:
                document = replace(stored.document, metadata=dict(metadata))
                self.tables.documents[key] = replace(stored, document=document)
                return _copy(document), False
            if chunks is None:
                return None  # the content changed meanwhile: the caller chunks the new one
            base = self.tables.bases.get((tenant.namespace, kb_ref))
            if base is None:
                raise LookupError("no such knowledge base")  # PostgreSQL: a foreign-key violation
            if base.generation != generation:
                raise StaleKnowledgeBases()
            document = DocumentRow(
                namespace=tenant.namespace,
                kb_ref=kb_ref,
                ref=ref,
                version=1 if stored is None else stored.document.version + 1,
                content_type=content_type,
                content_sha256=content_sha256,
                size_bytes=size_bytes,
                chunk_count=len(chunks),
                metadata=dict(metadata),
                # The document's creation: its first version's (an update keeps it).
                created_at=self.tables.clock.now() if stored is None else stored.document.created_at,
            )
            written = {generation: tuple(stored_chunk(document, c) for c in chunks)}
            migrating = self.tables.migrating.get((tenant.namespace, kb_ref))
            dual = next_chunks is not None and migrating is not None and migrating[0] == migration_id
            if dual:
                assert next_chunks is not None
                written[generation + 1] = tuple(stored_chunk(document, c) for c in next_chunks)
            self.tables.documents[key] = DocumentVersion(
                document,
                written,
                text,
                len(next_chunks) if dual and next_chunks is not None else None,
                tuple(source_spans),
            )
            return _copy(document), True

    async def delete_document(self, tenant: Tenant, kb_ref: str, ref: str) -> int | None:
        """Its version on its way in goes too (the runner working on it loses its lease): the
        current version's chunk count, 0 when it had none yet."""
        if not _visible(tenant, tenant.namespace, kb_ref):
            return None
        key = (tenant.namespace, kb_ref, ref)
        async with self.tables.lock:
            current = self.tables.documents.pop(key, None)
            queued = self.tables.ingestions.pop(key, None)
            if current is None and queued is None:
                return None
            return 0 if current is None else current.document.chunk_count

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
        """Counts the chunks of `kb_refs` up to `count_cap` (the filter not applied)."""
        if len(generations) != len(kb_refs):
            raise ValueError("one generation per knowledge base")
        if expect is not None:
            held = {
                (b.ref, b.created_at, b.generation)
                for ref in expect.roster
                if (b := self._base(tenant, ref)) is not None
            }
            if held != set(expect.created):
                raise StaleKnowledgeBases()
        generation_of = {
            ref: generation
            for ref, generation in zip(kb_refs, generations, strict=True)
            if _visible(tenant, tenant.namespace, ref)
        }
        versions = [
            (version, version.chunks.get(generation_of[kb], ()))
            for (ns, kb, _), version in self.tables.documents.items()
            if ns == tenant.namespace and kb in generation_of
        ]
        if row_count is None:
            row_count = min(count_cap, sum(len(chunks) for _, chunks in versions))
        query = plan(row_count)
        wanted = [(v, c) for v, c in versions if filter_ is None or matches(filter_, v.document.metadata)]
        # The chunks as they are now, before a pending vector is awaited: one snapshot.
        indexed = list(_indexed(wanted))
        return SearchOutcome(query.row_count, candidates(indexed, await query.with_vector()))


def stored_chunk(document: DocumentRow, chunk: ChunkRow) -> _Chunk:
    embedding = np.array(chunk.embedding, dtype=np.float32)
    embedding.setflags(write=False)
    passage = PassageRow(
        kb_ref=document.kb_ref,
        doc_ref=document.ref,
        version=document.version,
        chunk_index=chunk.index,
        text=chunk.text,
        start=chunk.start,
        end=chunk.end,
        heading_path=tuple(chunk.heading_path),
        location=chunk.location,
    )
    return _Chunk(passage, embedding, terms_of(chunk.text))


def _copy(document: DocumentRow) -> DocumentRow:
    return replace(document, metadata=dict(document.metadata))


def _indexed(
    versions: Iterable[tuple[DocumentVersion, tuple[_Chunk, ...]]],
) -> Iterable[Searchable[PassageRow]]:
    # A chunk's neighbours are the chunks before and after it in the same document version.
    for version, chunks in versions:
        document = version.document
        partition = (document.namespace, document.kb_ref, document.ref, document.version)
        for chunk in chunks:
            yield Searchable(
                item=chunk.passage,
                key=(*partition, chunk.passage.chunk_index),
                partition=partition,
                order=(chunk.passage.chunk_index,),
                local=chunk.passage.chunk_index,
                embedding=chunk.embedding,
                terms=chunk.terms,
            )
