"""Knowledge bases: corpus management, document ingestion and roster-enforced search.

Rules enforced here: the embedder and chunking strategy are pinned at creation (a different
choice for an existing ref is FAILED_PRECONDITION); re-uploading identical content is a no-op;
embedding happens before any write, so an embedder failure stores nothing; a launcher may search
only knowledge bases in its capability's roster, and a refusal names no other corpus.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from opentelemetry import trace

from tokensvc.audit import AuditKind, AuditLog
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import Embedder, EmbedderRegistry, EmbedderSpec
from tokensvc.errors import InvalidArgument, NotFound, PermissionDenied, PinnedConfiguration, Reason
from tokensvc.knowledge.chunking import Chunk, ChunkingStrategy, chunk_document
from tokensvc.knowledge.extract import extract_text
from tokensvc.memory.filters import Filter
from tokensvc.memory.metadata import MetadataScalar
from tokensvc.memory.ranking import RRF_K
from tokensvc.observability.metrics import observe_embedding
from tokensvc.storage.knowledge import BaseRow, ChunkRow, DocumentRow, PassageRow, PostgresKnowledgeStore
from tokensvc.storage.tenant import ALL_KNOWLEDGE_BASES, Tenant

__all__ = ["KnowledgeBases", "Passage", "UploadResult"]

_tracer = trace.get_tracer("tokensvc.knowledge")
_EMBED_BATCH = 64
_MAX_SEARCH_REFS = 16


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
        store: PostgresKnowledgeStore,
        embedders: EmbedderRegistry,
        *,
        audit: AuditLog,
        default_embedder: str,
        exact_threshold: int = 5000,
        ef_search: int = 64,
    ):
        self._store = store
        self._embedders = embedders
        self._audit = audit
        self._default = default_embedder
        self._exact_threshold = exact_threshold
        self._ef_search = ef_search

    # --- management (control plane, admin) --------------------------------------------------

    async def create(
        self,
        namespace: str,
        ref: str,
        display_name: str,
        embedder_name: str,
        chunking: ChunkingStrategy,
        *,
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
            if not created and _pinned(stored) != _pinned(wanted):
                raise PinnedConfiguration(
                    f"knowledge base {ref!r} is pinned to embedder {stored.embedder!r} and {stored.chunking} "
                    f"chunking ({stored.chunk_size}/{stored.chunk_overlap}); changing either needs re-embedding"
                )
            return stored, created

    async def get(self, namespace: str, ref: str) -> BaseRow:
        bases = await self._store.get_bases(_management(namespace), [ref])
        if not bases:
            raise NotFound(f"no knowledge base {ref!r} in namespace {namespace!r}")
        return bases[0]

    async def list_bases(self, namespace: str, *, after: str | None, limit: int) -> list[BaseRow]:
        return await self._store.list_bases(_management(namespace), after=after, limit=limit)

    async def delete(self, namespace: str, ref: str, *, actor: str) -> int:
        with _tracer.start_as_current_span("knowledge.delete", record_exception=False):
            count = await self._store.delete_base(_management(namespace), ref)
            if count is None:
                raise NotFound(f"no knowledge base {ref!r} in namespace {namespace!r}")
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
            base = await self.get(namespace, kb_ref)
            digest = hashlib.sha256(content).digest()
            current = await self._store.get_document(tenant, kb_ref, doc_ref)
            if current is not None and current.content_sha256 == digest:
                if current.metadata != metadata:
                    await self._store.update_metadata(tenant, kb_ref, doc_ref, metadata)
                    current = await self._store.get_document(tenant, kb_ref, doc_ref)
                    assert current is not None
                return UploadResult(current, unchanged=True)
            strategy = ChunkingStrategy.from_stored(base.chunking, base.chunk_size, base.chunk_overlap)
            # CPU-bound for large documents (seconds for tens of MiB): off the event loop.
            chunks = await asyncio.to_thread(_extract_and_chunk, content, content_type, strategy)
            embedder = self._embedder(base)
            vectors = await self._embed(embedder, [chunk.text for chunk in chunks])
            rows = [
                ChunkRow(c.index, c.text, c.start, c.end, tuple(c.heading_path), vector)
                for c, vector in zip(chunks, vectors, strict=True)
            ]
            document, written = await self._store.replace_document(
                tenant,
                kb_ref=kb_ref,
                ref=doc_ref,
                content_type=content_type,
                content_sha256=digest,
                size_bytes=len(content),
                metadata=metadata,
                chunks=rows,
            )
            span.set_attribute("tokensvc.result_count", len(rows))
            return UploadResult(document, unchanged=not written)

    async def _embed(self, embedder: Embedder, texts: list[str]) -> list[np.ndarray]:
        vectors: list[np.ndarray] = []
        with _tracer.start_as_current_span("embed", record_exception=False) as span:
            span.set_attribute("tokensvc.embed.count", len(texts))
            for start in range(0, len(texts), _EMBED_BATCH):
                batch = await observe_embedding(
                    embedder.spec.name, embedder.embed_documents(texts[start : start + _EMBED_BATCH])
                )
                vectors.extend(_unit_rows(batch))
        return vectors

    async def get_document(self, namespace: str, kb_ref: str, doc_ref: str) -> DocumentRow:
        await self.get(namespace, kb_ref)
        document = await self._store.get_document(_management(namespace), kb_ref, doc_ref)
        if document is None:
            raise NotFound(f"no document {doc_ref!r} in knowledge base {kb_ref!r}")
        return document

    async def list_documents(
        self, namespace: str, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow]:
        await self.get(namespace, kb_ref)
        return await self._store.list_documents(
            _management(namespace), kb_ref, after=after, limit=limit, filter_=filter_
        )

    async def delete_document(self, namespace: str, kb_ref: str, doc_ref: str) -> int:
        await self.get(namespace, kb_ref)
        count = await self._store.delete_document(_management(namespace), kb_ref, doc_ref)
        if count is None:
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
        hybrid: bool,
    ) -> list[Passage]:
        with _tracer.start_as_current_span("knowledge.search", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", scope.namespace)
            span.set_attribute("tokensvc.agent", scope.agent)
            refs = _authorised_refs(scope, refs)
            tenant = Tenant(scope.namespace, scope.agent, knowledge_bases=tuple(refs))
            bases = await self._store.get_bases(tenant, refs)
            groups: dict[EmbedderSpec, list[str]] = {}
            for base in bases:
                groups.setdefault(_spec(base), []).append(base.ref)
            candidates = max(top_k, 50) if hybrid else top_k
            ranked: list[list[Passage]] = []
            for spec, group in groups.items():
                embedder = self._embedder_for(spec)
                with _tracer.start_as_current_span("embed", record_exception=False):
                    query_vector = await observe_embedding(spec.name, embedder.embed_query(query))
                vector = _unit_rows(np.asarray([query_vector]))[0]
                exact = (
                    await self._store.chunk_count(tenant, group, self._exact_threshold + 1)
                    <= self._exact_threshold
                )
                search = functools.partial(
                    self._store.search,
                    tenant,
                    group,
                    query_vector=vector,
                    query_text=query if hybrid else None,
                    k=candidates,
                    filter_=filter_,
                    ef_search=max(self._ef_search, 2 * candidates),
                )
                exact = exact or spec.dimension > 2000
                rows = await search(exact=exact)
                if not exact and sum(row.ranker == "vector" for row in rows) < candidates:
                    # The approximate scan stopped early: search exactly so results stay complete.
                    rows = await search(exact=True)
                ranked.append(_fuse(rows) if hybrid else _vector_only(rows))
            passages = _merge(ranked)
            if min_score is not None:
                passages = [p for p in passages if p.score >= min_score]
            passages = passages[:top_k]
            span.set_attribute("tokensvc.result_count", len(passages))
            return passages

    def _embedder(self, base: BaseRow) -> Embedder:
        return self._embedder_for(_spec(base))

    def _embedder_for(self, spec: EmbedderSpec) -> Embedder:
        if spec.name not in self._embedders.names or self._embedders.get(spec.name).spec != spec:
            raise PinnedConfiguration(
                f"the knowledge base is pinned to embedder {spec.name!r} (model {spec.model!r}, "
                f"{spec.dimension} dimensions), which is not configured the same way any more"
            )
        return self._embedders.get(spec.name)


def _extract_and_chunk(content: bytes, content_type: str, strategy: ChunkingStrategy) -> list[Chunk]:
    return chunk_document(extract_text(content, content_type), strategy)


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


def _unit_rows(matrix: np.ndarray) -> list[np.ndarray]:
    matrix = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    if not np.isfinite(norms).all() or (norms == 0).any():
        raise InvalidArgument("content", "produced an embedding that cannot be normalised")
    return list(np.ascontiguousarray(matrix / norms))


def _passage(row: PassageRow, score: float, vector_rank: int, text_rank: int) -> Passage:
    return Passage(
        row.kb_ref,
        row.doc_ref,
        row.version,
        row.chunk_index,
        row.text,
        row.start,
        row.end,
        row.heading_path,
        score,
        vector_rank,
        text_rank,
    )


def _vector_only(rows: Sequence[PassageRow]) -> list[Passage]:
    # Ranks are reported in HYBRID mode only; the proto promises 0 for both in VECTOR mode.
    return [_passage(row, row.score, 0, 0) for row in sorted(rows, key=lambda r: r.rank)]


def _fuse(rows: Sequence[PassageRow]) -> list[Passage]:
    """Reciprocal rank fusion of the statement's vector and text rankings."""
    by_key: dict[tuple[str, str, int], tuple[PassageRow, int, int]] = {}
    for row in rows:
        key = (row.kb_ref, row.doc_ref, row.chunk_index)
        found, vector_rank, text_rank = by_key.get(key, (row, 0, 0))
        if row.ranker == "vector":
            vector_rank = row.rank
        else:
            text_rank = row.rank
        by_key[key] = (found, vector_rank, text_rank)
    fused = [
        _passage(row, (1 / (RRF_K + v) if v else 0.0) + (1 / (RRF_K + t) if t else 0.0), v, t)
        for row, v, t in by_key.values()
    ]
    fused.sort(key=lambda p: (-p.score, p.vector_rank or 1 << 30, p.citation))
    return fused


def _merge(groups: list[list[Passage]]) -> list[Passage]:
    if len(groups) == 1:
        return groups[0]
    merged = [passage for group in groups for passage in group]
    merged.sort(key=lambda p: -p.score)
    return merged
