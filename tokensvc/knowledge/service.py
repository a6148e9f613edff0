"""Knowledge bases: corpus management, document ingestion and roster-enforced search.

Rules enforced here: the embedder and chunking strategy are pinned at creation (a different
choice for an existing ref is FAILED_PRECONDITION); re-uploading identical content is a no-op;
an upload is stored durably and ingested in the background (`tokensvc.knowledge.ingestion`), its
version searchable only once READY, the previous one meanwhile; a launcher may search only
knowledge bases in its capability's roster, and a refusal names no other corpus. Searches
run through the retrieval engine (`tokensvc.retrieval.engine`), one per (embedder, text
configuration) group of the searched bases; what a search remembers between calls (the bases'
pins, row counts) is a store decorator's (`tokensvc.storage.caching`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from tokensvc.audit import AuditKind, AuditLog
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import EmbedderRegistry, EmbedderSpec, ScheduledEmbedder
from tokensvc.errors import (
    ConcurrentChange,
    DatabaseUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PinnedConfiguration,
    Reason,
)
from tokensvc.knowledge.chunking import ChunkingStrategy
from tokensvc.knowledge.formats import Location
from tokensvc.knowledge.ingestion import IngestionRunner
from tokensvc.memory import Filter
from tokensvc.memory.metadata import MetadataScalar
from tokensvc.retrieval import (
    DEFAULT_TEXT_CONFIG,
    QueryEmbedding,
    Ranked,
    Retrieval,
    RetrievalEngine,
    SearchMode,
    SearchTuning,
    validate_text_config,
)
from tokensvc.storage.ports import IngestionStore, KnowledgeStore, StaleKnowledgeBases
from tokensvc.storage.records import (
    ALL_KNOWLEDGE_BASES,
    NOWHERE,
    BaseRow,
    DocumentRow,
    DocumentState,
    KnowledgePins,
    PassageRow,
    Tenant,
)

__all__ = ["KnowledgeBases", "Passage", "UploadResult"]

_tracer = trace.get_tracer("tokensvc.knowledge")
_MAX_SEARCH_REFS = 16
# A document read with its text whose version changes in between is read again.
_READ_ATTEMPTS = 3
# How often an upload that waits reads its document while another replica ingests it.
_READY_POLL_SECONDS = 0.25
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
        ingestions: IngestionStore,
        ingestion: IngestionRunner | None,
        default_embedder: str,
        default_text_config: str = DEFAULT_TEXT_CONFIG,
        engine: RetrievalEngine | None = None,
    ):
        self._store = store
        self._ingestions = ingestions
        self._ingestion = ingestion
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
        *,
        wait: bool = False,
    ) -> UploadResult:
        """Store the upload durably and queue its ingestion: the new version PENDING (or, for the
        newest version's content, the document unchanged). `wait`: work on it here at once and
        return when it is READY (its refusal raised, and nothing kept), as a caller of a small
        document wants; the caller's deadline ends the wait, not the work."""
        with _tracer.start_as_current_span("knowledge.upload", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", namespace)
            span.set_attribute("tokensvc.upload.bytes", len(content))
            enqueued = await self._ingestions.enqueue(
                _management(namespace),
                kb_ref=kb_ref,
                ref=doc_ref,
                content_type=content_type,
                content_sha256=hashlib.sha256(content).digest(),
                size_bytes=len(content),
                metadata=metadata,
                content=content,
            )
            if enqueued is None:
                raise _no_base(namespace, kb_ref)
            job, runner = enqueued.ingestion, self._ingestion
            if job is None:
                return UploadResult(enqueued.document, enqueued.unchanged)
            if not wait:
                if runner is not None:
                    runner.wake()
                return UploadResult(enqueued.document, enqueued.unchanged)
            # At once, here (unless another replica took it first: then its result is awaited).
            outcome = None if runner is None else await runner.ingest_now(job)
            if isinstance(outcome, InvalidArgument):
                assert runner is not None
                await self._ingestions.discard(job, runner.runner_id)
                raise outcome
            document = outcome or await self._ready(namespace, kb_ref, doc_ref, job.version)
            span.set_attribute("tokensvc.result_count", document.chunk_count)
            return UploadResult(document, enqueued.unchanged)

    async def _ready(self, namespace: str, kb_ref: str, doc_ref: str, version: int) -> DocumentRow:
        """The document once `version` (or a newer one) is READY, read every `_READY_POLL_SECONDS`
        while another runner works on it; its failure as the upload's refusal."""
        while True:
            document = await self.get_document(namespace, kb_ref, doc_ref)
            if document.version > version or document.state is DocumentState.READY:
                return document
            if document.state is DocumentState.FAILED:
                raise InvalidArgument("content", document.failure_reason)
            await asyncio.sleep(_READY_POLL_SECONDS)

    async def get_document(
        self, namespace: str, kb_ref: str, doc_ref: str, *, with_text: bool = False
    ) -> DocumentRow:
        """The document's newest version (READY, or on its way in); `with_text`: with the
        searchable version's extracted text, read after it (a new version in between: read
        again; none searchable yet: empty)."""
        tenant = _management(namespace)
        for _ in range(_READ_ATTEMPTS):
            base, document = await self._store.document_state(tenant, kb_ref, doc_ref)
            if base is None:
                raise _no_base(namespace, kb_ref)
            if document is None:
                raise NotFound(f"no document {doc_ref!r} in knowledge base {kb_ref!r}")
            if not with_text:
                return document
            if document.searchable_version is None:
                return dataclasses.replace(document, text="")
            text = await self._store.document_text(tenant, kb_ref, doc_ref, document.searchable_version)
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
        embedding = None
        if mode is not SearchMode.TEXT:
            embedding = QueryEmbedding(self._embedder_for(spec), query, tenant.namespace, tenant.agent)
        retrieval = Retrieval(
            mode=mode,
            text=query,
            vector=None,
            embedding=embedding,
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
