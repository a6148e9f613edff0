"""Knowledge bases: corpus management, document ingestion and roster-enforced search.

Rules enforced here: the embedder and chunking strategy are pinned at creation (a different
choice for an existing ref is FAILED_PRECONDITION); re-uploading identical content is a no-op;
embedding happens before any write, so an embedder failure stores nothing; a launcher may search
only knowledge bases in its capability's roster, and a refusal names no other corpus. Searches
run through the retrieval engine (`tokensvc.retrieval.engine`), one per (embedder, text
configuration) group of the searched bases; what a search remembers between calls (the bases'
pins, row counts) is a store decorator's (`tokensvc.storage.caching`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from opentelemetry import trace

from tokensvc.audit import AuditKind, AuditLog
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import (
    Demand,
    EmbedderRegistry,
    EmbedderSpec,
    ScheduledEmbedder,
    WorkClass,
)
from tokensvc.errors import (
    ConcurrentChange,
    DatabaseUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PinnedConfiguration,
    Reason,
)
from tokensvc.knowledge.chunking import Chunk, ChunkingStrategy
from tokensvc.knowledge.extraction_pool import ExtractionPool
from tokensvc.knowledge.formats import OCTET_STREAM, Location
from tokensvc.memory import Filter
from tokensvc.memory.metadata import MetadataScalar
from tokensvc.observability.metrics import observe_embedding
from tokensvc.retrieval import (
    DEFAULT_TEXT_CONFIG,
    Ranked,
    Retrieval,
    RetrievalEngine,
    SearchMode,
    SearchTuning,
    embed_query,
    unit_rows,
    validate_text_config,
)
from tokensvc.storage.ports import KnowledgeStore, StaleKnowledgeBases
from tokensvc.storage.records import (
    ALL_KNOWLEDGE_BASES,
    NOWHERE,
    BaseRow,
    ChunkRow,
    DocumentRow,
    KnowledgePins,
    PassageRow,
    Tenant,
)

__all__ = ["KnowledgeBases", "Passage", "UploadResult"]

_tracer = trace.get_tracer("tokensvc.knowledge")
_EMBED_BATCH = 64
_MAX_SEARCH_REFS = 16
# A cutover between reading the base and writing the version makes the upload start over; two
# cutovers in a row of one base cannot happen (the old generation is retired first).
_UPLOAD_ATTEMPTS = 3
# A search with remembered pins that no longer hold reads them afresh and runs again; a second
# refusal needs another base created, deleted or cut over meanwhile.
_SEARCH_ATTEMPTS = 3


@dataclass(frozen=True)
class Passage:
    kb_ref: str
    doc_ref: str
    version: int
    chunk_index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...]
    score: float
    vector_rank: int
    text_rank: int
    location: Location = NOWHERE

    @property
    def citation(self) -> str:
        return f"{self.doc_ref}#{self.chunk_index}"


@dataclass(frozen=True)
class UploadResult:
    document: DocumentRow
    unchanged: bool


class KnowledgeBases:
    def __init__(
        self,
        store: KnowledgeStore,
        embedders: EmbedderRegistry,
        *,
        audit: AuditLog,
        extraction: ExtractionPool,
        default_embedder: str,
        default_text_config: str = DEFAULT_TEXT_CONFIG,
        engine: RetrievalEngine | None = None,
    ):
        self._store = store
        self._extraction = extraction
        self._embedders = embedders
        self._audit = audit
        self._default = default_embedder
        self._default_text_config = default_text_config
        self._engine = engine or RetrievalEngine(SearchTuning(exact_threshold=5000))

    # --- management (control plane, admin) --------------------------------------------------

    async def create(
        self,
        namespace: str,
        ref: str,
        display_name: str,
        embedder_name: str,
        chunking: ChunkingStrategy,
        *,
        text_config: str = "",
        actor: str,
    ) -> tuple[BaseRow, bool]:
        with _tracer.start_as_current_span("knowledge.create", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", namespace)
            name = embedder_name or self._default
            if name not in self._embedders.names:
                raise InvalidArgument(
                    "embedder",
                    f"{name!r} is not configured; configured embedders: {', '.join(self._embedders.names)}",
                )
            spec = self._embedders.get(name).spec
            config = validate_text_config(text_config, "text_search_config") if text_config else None
            wanted = BaseRow(
                namespace=namespace,
                ref=ref,
                display_name=display_name,
                embedder=spec.name,
                model=spec.model,
                dimension=spec.dimension,
                normalized=spec.normalized,
                chunking=str(chunking.kind.value),
                chunk_size=chunking.chunk_size,
                chunk_overlap=chunking.chunk_overlap,
                text_config=config or self._default_text_config,
                created_at=None,  # type: ignore[arg-type]
            )
            stored, created = await self._store.create_base(_management(namespace), wanted)
            if created:
                await self._audit.record(
                    AuditKind.KNOWLEDGE_BASE_CREATION,
                    actor=actor,
                    action="create knowledge base",
                    target=f"{namespace}/{ref}",
                    detail=f"embedder {spec.name}, {chunking.kind.value} chunking",
                )
            # An empty text_search_config asks for no particular one: the pinned one stands.
            if not created and (
                _pinned(stored) != _pinned(wanted) or (config is not None and config != stored.text_config)
            ):
                raise PinnedConfiguration(
                    f"knowledge base {ref!r} is pinned to embedder {stored.embedder!r}, {stored.chunking} "
                    f"chunking ({stored.chunk_size}/{stored.chunk_overlap}) and text-search configuration "
                    f"{stored.text_config!r}; changing them needs re-indexing"
                )
            return stored, created

    async def get(self, namespace: str, ref: str) -> BaseRow:
        bases = await self._store.get_bases(_management(namespace), [ref])
        if not bases:
            raise _no_base(namespace, ref)
        return bases[0]

    async def list_bases(self, namespace: str, *, after: str | None, limit: int) -> list[BaseRow]:
        return await self._store.list_bases(_management(namespace), after=after, limit=limit)

    async def delete(self, namespace: str, ref: str, *, actor: str) -> int:
        with _tracer.start_as_current_span("knowledge.delete", record_exception=False):
            count = await self._store.delete_base(_management(namespace), ref)
            if count is None:
                raise _no_base(namespace, ref)
            await self._audit.record(
                AuditKind.KNOWLEDGE_BASE_DELETION,
                actor=actor,
                action="delete knowledge base",
                target=f"{namespace}/{ref}",
                detail=f"{count} documents",
            )
            return count

    async def upload(
        self,
        namespace: str,
        kb_ref: str,
        doc_ref: str,
        content_type: str,
        metadata: dict[str, MetadataScalar],
        content: bytes,
    ) -> UploadResult:
        with _tracer.start_as_current_span("knowledge.upload", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", namespace)
            span.set_attribute("tokensvc.upload.bytes", len(content))
            tenant = _management(namespace)
            digest = hashlib.sha256(content).digest()
            replace = functools.partial(
                self._store.replace_document,
                tenant,
                kb_ref=kb_ref,
                ref=doc_ref,
                content_type=content_type,
                content_sha256=digest,
                size_bytes=len(content),
                metadata=metadata,
            )
            for _ in range(_UPLOAD_ATTEMPTS):
                base, current = await self._store.document_state(tenant, kb_ref, doc_ref)
                if base is None:
                    raise _no_base(namespace, kb_ref)
                if current is not None and current.content_sha256 == digest:
                    if current.metadata == metadata:
                        return UploadResult(current, unchanged=True)
                    # Same bytes, new metadata: no chunking or embedding. None: the content
                    # changed meanwhile (a concurrent upload), so this one is chunked after all.
                    replaced = await replace(chunks=None)
                    if replaced is not None:
                        return UploadResult(replaced[0], unchanged=True)
                try:
                    return await self._write_version(base, content, content_type, replace, span)
                except StaleKnowledgeBases:
                    # A migration cut over since `base` was read: chunk and embed for the new pins.
                    span.set_attribute("tokensvc.upload.stale_generation", True)
        raise DatabaseUnavailable("the knowledge base changed embedder while uploading; retry")

    async def _write_version(
        self,
        base: BaseRow,
        content: bytes,
        content_type: str,
        replace: Callable[..., Awaitable[tuple[DocumentRow, bool] | None]],
        span: trace.Span,
    ) -> UploadResult:
        strategy = ChunkingStrategy.from_stored(base.chunking, base.chunk_size, base.chunk_overlap)
        # During the base's migration, the target's chunks too (when this replica has its embedder).
        target = self._migration_target(base)
        strategies = (strategy,) if target is None or target[1] == strategy else (strategy, target[1])
        # In a worker process, stopped when this call ends (see knowledge/extraction_pool.py).
        extraction = await self._extraction.extract(content, content_type, strategies)
        # Uploads are bulk work in their namespace's fair share: searches and Remembers go first.
        demand = Demand.of(WorkClass.BULK, base.namespace)
        rows = await self._embedded(
            self._embedder(base), extraction.chunkings[0], extraction.locations[0], demand
        )
        next_rows = None
        if target is not None:
            next_rows = await self._embedded(
                target[0], extraction.chunkings[-1], extraction.locations[-1], demand
            )
        # Sent as bytes of no declared type: stored as the type its signature showed.
        declared = content_type.partition(";")[0].strip().lower()
        replaced = await replace(
            chunks=rows,
            generation=base.generation,
            text=extraction.text,
            next_chunks=next_rows,
            migration_id=base.migration_id if next_rows is not None else None,
            source_spans=extraction.spans,
            **({"content_type": extraction.media_type} if declared == OCTET_STREAM else {}),
        )
        assert replaced is not None  # with chunks, a version or the same content is stored
        document, written = replaced
        span.set_attribute("tokensvc.result_count", len(rows))
        return UploadResult(document, unchanged=not written)

    def _migration_target(self, base: BaseRow) -> tuple[ScheduledEmbedder, ChunkingStrategy] | None:
        spec, chunking = base.migrating_to, base.migrating_chunking
        if spec is None or chunking is None or spec.name not in self._embedders.names:
            return None
        embedder = self._embedders.get(spec.name)
        if embedder.spec != spec:
            return None  # configured differently here: the runner embeds it for the target
        return embedder, ChunkingStrategy.from_stored(chunking.kind, chunking.size, chunking.overlap)

    async def _embedded(
        self,
        embedder: ScheduledEmbedder,
        chunks: list[Chunk],
        locations: tuple[Location, ...],
        demand: Demand,
    ) -> list[ChunkRow]:
        vectors = await self._embed(embedder, [chunk.text for chunk in chunks], demand)
        return [
            ChunkRow(c.index, c.text, c.start, c.end, tuple(c.heading_path), vector, location)
            for c, vector, location in zip(chunks, vectors, locations, strict=True)
        ]

    async def _embed(self, embedder: ScheduledEmbedder, texts: list[str], demand: Demand) -> list[np.ndarray]:
        vectors: list[np.ndarray] = []
        with _tracer.start_as_current_span("embed", record_exception=False) as span:
            span.set_attribute("tokensvc.embed.count", len(texts))
            for start in range(0, len(texts), _EMBED_BATCH):
                part = texts[start : start + _EMBED_BATCH]
                batch = await observe_embedding(
                    embedder.spec.name, embedder.embed_documents(part, demand), texts=len(part)
                )
                vectors.extend(unit_rows(batch, "content"))
        return vectors

    async def get_document(
        self, namespace: str, kb_ref: str, doc_ref: str, *, with_text: bool = False
    ) -> DocumentRow:
        """The document's current version; `with_text`: with its extracted text, read after it
        (a new version in between: read again)."""
        tenant = _management(namespace)
        for _ in range(_UPLOAD_ATTEMPTS):
            base, document = await self._store.document_state(tenant, kb_ref, doc_ref)
            if base is None:
                raise _no_base(namespace, kb_ref)
            if document is None:
                raise NotFound(f"no document {doc_ref!r} in knowledge base {kb_ref!r}")
            if not with_text:
                return document
            text = await self._store.document_text(tenant, kb_ref, doc_ref, document.version)
            if text is not None:
                return dataclasses.replace(document, text=text)
        raise ConcurrentChange(f"document {doc_ref!r} kept changing while it was read; retry")

    async def list_documents(
        self, namespace: str, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow]:
        documents = await self._store.list_documents(
            _management(namespace), kb_ref, after=after, limit=limit, filter_=filter_
        )
        if documents is None:
            raise _no_base(namespace, kb_ref)
        return documents

    async def delete_document(self, namespace: str, kb_ref: str, doc_ref: str) -> int:
        count = await self._store.delete_document(_management(namespace), kb_ref, doc_ref)
        if count is None:
            await self.get(namespace, kb_ref)  # which of the two is missing decides the message
            raise NotFound(f"no document {doc_ref!r} in knowledge base {kb_ref!r}")
        return count

    # --- search (launchers) -----------------------------------------------------------------

    async def search(
        self,
        scope: TenantScope,
        refs: Sequence[str],
        *,
        query: str,
        top_k: int,
        min_score: float | None,
        filter_: Filter | None,
        mode: SearchMode,
    ) -> list[Passage]:
        with _tracer.start_as_current_span("knowledge.search", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", scope.namespace)
            span.set_attribute("tokensvc.agent", scope.agent)
            span.set_attribute("tokensvc.search.mode", str(mode))
            refs = _authorised_refs(scope, refs)
            tenant = Tenant(scope.namespace, scope.agent, knowledge_bases=tuple(refs))
            wanted = (query, top_k, min_score, filter_, mode)
            # The bases' pins (what to embed the query with) may be remembered from an earlier
            # search; then this search's own transaction checks they still hold, so a warm search
            # is one transaction, and a stale one is run again with the pins read afresh.
            for _ in range(_SEARCH_ATTEMPTS):
                bases, pins = await self._store.bases_for_search(tenant, refs)
                try:
                    ranked = await self._search_bases(tenant, bases, pins, *wanted)
                    break
                except StaleKnowledgeBases:
                    span.set_attribute("tokensvc.search.stale_pins", True)
            else:
                raise DatabaseUnavailable("the knowledge bases changed while searching; retry")
            passages = [_passage(r) for r in ranked[:top_k]]
            span.set_attribute("tokensvc.result_count", len(passages))
            return passages

    async def _search_bases(
        self,
        tenant: Tenant,
        bases: Sequence[BaseRow],
        pins: KnowledgePins | None,
        query: str,
        top_k: int,
        min_score: float | None,
        filter_: Filter | None,
        mode: SearchMode,
    ) -> list[Ranked[PassageRow]]:
        # One search per (embedder, text config): vectors and lexemes compare only within one.
        groups: dict[tuple[EmbedderSpec, str], list[BaseRow]] = {}
        for base in bases:
            groups.setdefault((_spec(base), base.text_config), []).append(base)
        ranked: list[Ranked[PassageRow]] = []
        for (spec, text_config), group in groups.items():
            ranked += await self._search_group(
                tenant, spec, text_config, group, pins, query, top_k, min_score, filter_, mode
            )
        if len(groups) > 1:
            ranked.sort(key=lambda r: -r.score)
        return ranked

    async def _search_group(
        self,
        tenant: Tenant,
        spec: EmbedderSpec,
        text_config: str,
        bases: list[BaseRow],
        pins: KnowledgePins | None,
        query: str,
        top_k: int,
        min_score: float | None,
        filter_: Filter | None,
        mode: SearchMode,
    ) -> list[Ranked[PassageRow]]:
        vector = None
        if mode is not SearchMode.TEXT:
            vector = await embed_query(self._embedder_for(spec), query, tenant.namespace, tenant.agent)
        retrieval = Retrieval(
            mode=mode,
            text=query,
            vector=vector,
            top_k=top_k,
            min_score=min_score,
            filtered=filter_ is not None,
            text_config=text_config,
            dimension=spec.dimension,
        )
        return await self._engine.search(
            retrieval,
            lambda plan: self._store.search(
                tenant,
                [base.ref for base in bases],
                plan,
                count_cap=plan.count_cap,
                filter_=filter_,
                generations=[base.generation for base in bases],
                expect=pins,
            ),
        )

    def _embedder(self, base: BaseRow) -> ScheduledEmbedder:
        return self._embedder_for(_spec(base))

    def _embedder_for(self, spec: EmbedderSpec) -> ScheduledEmbedder:
        if spec.name not in self._embedders.names or self._embedders.get(spec.name).spec != spec:
            raise PinnedConfiguration(
                f"the knowledge base is pinned to embedder {spec.name!r} (model {spec.model!r}, "
                f"{spec.dimension} dimensions), which is not configured the same way any more"
            )
        return self._embedders.get(spec.name)


def _no_base(namespace: str, ref: str) -> NotFound:
    return NotFound(f"no knowledge base {ref!r} in namespace {namespace!r}")


def _management(namespace: str) -> Tenant:
    return Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))


def _spec(base: BaseRow) -> EmbedderSpec:
    return EmbedderSpec(base.embedder, base.model, base.dimension, base.normalized)


def _pinned(base: BaseRow) -> tuple[Any, ...]:
    return (base.embedder, base.model, base.dimension, base.chunking, base.chunk_size, base.chunk_overlap)


def _authorised_refs(scope: TenantScope, refs: Sequence[str]) -> list[str]:
    roster = set(scope.knowledge_bases)
    if not refs:
        if not roster:
            raise PermissionDenied(Reason.SCOPE_NOT_GRANTED)
        return sorted(roster)
    if len(refs) > _MAX_SEARCH_REFS:
        raise InvalidArgument("knowledge_base_refs", f"at most {_MAX_SEARCH_REFS} knowledge bases per search")
    for index, ref in enumerate(refs):
        if ref not in roster:
            # Whether or not it exists: the refusal must not reveal other corpora. It names the
            # offending position (the proto's `knowledge_base_refs[i]`), never a ref.
            refused = PermissionDenied(Reason.SCOPE_NOT_GRANTED)
            refused.field = f"knowledge_base_refs[{index}]"
            raise refused
    return list(dict.fromkeys(refs))


def _passage(ranked: Ranked[PassageRow]) -> Passage:
    row = ranked.item
    return Passage(
        row.kb_ref,
        row.doc_ref,
        row.version,
        row.chunk_index,
        row.text,
        row.start,
        row.end,
        row.heading_path,
        ranked.score,
        ranked.vector_rank,
        ranked.text_rank,
        row.location,
    )
