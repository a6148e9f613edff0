"""Long-term memory: the business rules between the API edge and storage.

Rules enforced here: the capability must enable long-term memory; a memory space's embedder is
pinned at its first write and a later configuration change is refused (re-embedding would be
needed); content is deduplicated per bucket after NFC normalisation and trimming; embedding
happens before any write, so an embedder failure leaves nothing half-written; rows under an older
pepper version's bucket move to the current bucket on first access. A re-embedding migration
(`tokensvc.reembedding`) changes a pin explicitly: a write that embedded for the old
generation is refused by storage (`StaleMemorySpace`) and done again for the new one. Pins and
bucket row counts are cached, if at all, by a decorator around the store
(`tokensvc.storage.caching`), for a while only, so every replica follows a cutover; searches run
through the retrieval engine (`tokensvc.retrieval.engine`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import unicodedata
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from opentelemetry import trace

from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import (
    Demand,
    EmbedderRegistry,
    EmbedderSpec,
    ScheduledEmbedder,
    WorkClass,
)
from tokensvc.errors import (
    AlreadyExists,
    ConcurrentChange,
    DatabaseUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PinnedConfiguration,
    Reason,
)
from tokensvc.memory.metadata import MAX_METADATA_ENTRIES, MetadataScalar
from tokensvc.memory.models import MemoryRecord, MemorySpace, NewMemory
from tokensvc.memory.paging import PageCursor
from tokensvc.observability.metrics import observe_embedding
from tokensvc.retrieval import (
    DEFAULT_TEXT_CONFIG,
    QueryEmbedding,
    Ranked,
    Retrieval,
    RetrievalEngine,
    SearchMode,
    SearchTuning,
    unit_vector,
)
from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ports import MemoryStore, StaleMemorySpace
from tokensvc.storage.records import Tenant

__all__ = ["LongTermMemory", "RememberItem", "SearchHit", "SearchMode", "SearchQuery", "SearchTuning"]

_log = logging.getLogger(__name__)
_tracer = trace.get_tracer("tokensvc.memory")
T = TypeVar("T")
# A write refused because a migration cut over (embedded again for the new pin), or rolled back
# for a conflict with another transaction, is tried this many times in all.
_WRITE_ATTEMPTS = 3
_CONFLICT_PAUSE_S = 0.05  # before the second attempt; twice that before the third

SearchHit = Ranked[MemoryRecord]


@dataclass(frozen=True)
class RememberItem:
    content: str
    metadata: dict[str, MetadataScalar]
    idempotency_key: str | None
    ttl_seconds: int | None


@dataclass(frozen=True)
class SearchQuery:
    text: str | None
    vector: np.ndarray | None
    top_k: int
    min_score: float | None
    filter: Filter | None
    mode: SearchMode


@dataclass(frozen=True)
class _Space:
    tenant: Tenant  # declares the space's generation: its vector slot, and the writes' guard
    bucket: str
    spec: EmbedderSpec
    text_config: str
    embedder: ScheduledEmbedder | None
    migrating_to: EmbedderSpec | None = None


def normalise_content(content: str) -> str:
    return unicodedata.normalize("NFC", content).strip()


def content_hash(normalised: str) -> bytes:
    return hashlib.sha256(normalised.encode("utf-8")).digest()


class LongTermMemory:
    def __init__(
        self,
        store: MemoryStore,
        embedders: EmbedderRegistry,
        *,
        default_embedder: str,
        default_text_config: str = DEFAULT_TEXT_CONFIG,
        engine: RetrievalEngine | None = None,
    ):
        self._store = store
        self._embedders = embedders
        self._default = default_embedder
        self._default_text_config = default_text_config
        self._engine = engine or RetrievalEngine()
        # Buckets whose older-pepper rows were already moved by this process.
        self._moved: set[str] = set()

    @property
    def engine(self) -> RetrievalEngine:
        """The retrieval engine its searches run through (its tuning: what a benchmark replays)."""
        return self._engine

    # --- space and scope --------------------------------------------------------------------

    async def _space(self, scope: TenantScope, *, for_write: bool) -> _Space | None:
        if not scope.long_term_memory:
            raise PermissionDenied(Reason.SCOPE_NOT_GRANTED)
        tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id, *scope.previous_bucket_ids))
        if scope.previous_bucket_ids and scope.bucket_id not in self._moved:
            await self._store.move_buckets(tenant, scope.bucket_id, scope.previous_bucket_ids)
            self._moved.add(scope.bucket_id)
        tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id,))
        pinned = await self._store.get_space(tenant)
        if pinned is None:
            if not for_write:
                return None
            wanted = MemorySpace(self._embedders.get(self._default).spec, self._default_text_config)
            pinned = await self._store.pin_space(tenant, wanted)
        spec = pinned.embedder
        tenant = Tenant(
            scope.namespace,
            scope.agent,
            (scope.bucket_id,),
            generation=pinned.generation,
            dual_write=pinned.migration_id if pinned.migrating_to is not None else None,
        )
        return _Space(
            tenant,
            scope.bucket_id,
            spec,
            pinned.text_config,
            self._pinned_embedder(spec),
            pinned.migrating_to,
        )

    async def _fresh(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run a write; when a migration's cutover made its pin stale, redo it (a caching store
        forgets a pin its store refused, so the pin is read again), and when the database rolled it
        back for a conflict, redo it after a pause. On Citus a write's share lock on its space row is
        a lock on the whole replicated table, so a cutover or a first write of another space can
        deadlock with it: the cluster cancels one of them."""
        failure: DatabaseUnavailable = DatabaseUnavailable(
            "the memory space changed embedder while writing; retry"
        )
        for number in range(1, _WRITE_ATTEMPTS + 1):
            try:
                return await attempt()
            except StaleMemorySpace:
                continue  # embedded for a generation that is gone: read the pin and embed again
            except ConcurrentChange as exc:
                failure = exc
                if number < _WRITE_ATTEMPTS:
                    await asyncio.sleep(_CONFLICT_PAUSE_S * number)
        raise failure

    def _pinned_embedder(self, spec: EmbedderSpec) -> ScheduledEmbedder | None:
        """The configured embedder matching the pin, None if the name is gone; refuse a drifted one."""
        if spec.name not in self._embedders.names:
            return None
        embedder = self._embedders.get(spec.name)
        if embedder.spec != spec:
            raise PinnedConfiguration(
                f"this memory space is pinned to embedder {spec.name!r} (model {spec.model!r}, "
                f"{spec.dimension} dimensions); the configured {spec.name!r} differs, and changing it "
                "needs a re-embedding"
            )
        return embedder

    def _require_embedder(self, space: _Space) -> ScheduledEmbedder:
        if space.embedder is None:
            raise PinnedConfiguration(
                f"this memory space is pinned to embedder {space.spec.name!r}, which is not configured"
            )
        return space.embedder

    # --- writes -----------------------------------------------------------------------------

    async def remember(self, scope: TenantScope, items: Sequence[RememberItem]) -> list[tuple[str, bool]]:
        """An (id, deduplicated) per item, in order; all-or-nothing."""
        return await self._fresh(lambda: self._remember(scope, items))

    async def _remember(self, scope: TenantScope, items: Sequence[RememberItem]) -> list[tuple[str, bool]]:
        with _tracer.start_as_current_span("memory.remember", record_exception=False) as span:
            _annotate(span, scope, items=len(items))
            space = await self._space(scope, for_write=True)
            assert space is not None
            embedder = self._require_embedder(space)
            normalised = [normalise_content(item.content) for item in items]
            hashes = [content_hash(text) for text in normalised]
            keys = [item.idempotency_key for item in items if item.idempotency_key]
            existing = await self._store.find_existing(space.tenant, space.bucket, hashes, keys)
            by_hash = {ref.content_sha256: ref for ref in existing}
            by_key = {ref.idempotency_key: ref for ref in existing if ref.idempotency_key}

            resolved: list[tuple[str, bool] | None] = []
            fresh: dict[bytes, int] = {}  # content hash -> index into `pending`
            pending: list[int] = []
            batch_keys: dict[str, bytes] = {}  # idempotency key -> content hash, within this call
            for index, (item, digest) in enumerate(zip(items, hashes, strict=True)):
                key_ref = by_key.get(item.idempotency_key) if item.idempotency_key else None
                if item.idempotency_key and (
                    batch_keys.setdefault(item.idempotency_key, digest) != digest
                    or (key_ref is not None and key_ref.content_sha256 != digest)
                ):
                    raise AlreadyExists(
                        "this idempotency key was already used for different content",
                        field=f"items[{index}].idempotency_key",
                    )
                if key_ref is not None:
                    resolved.append((key_ref.id, True))
                elif digest in by_hash:
                    resolved.append((by_hash[digest].id, True))
                elif digest in fresh:
                    resolved.append(None)  # a repeat within this batch: same id as its first
                else:
                    fresh[digest] = index
                    pending.append(index)
                    resolved.append(None)

            if pending:
                texts = [normalised[i] for i in pending]
                vectors, nexts = await asyncio.gather(
                    self._embed_documents(embedder, texts, space), self._embed_for_migration(space, texts)
                )
                rows = [
                    NewMemory(
                        id=str(uuid.uuid4()),
                        content=normalised[i],
                        content_sha256=hashes[i],
                        metadata=items[i].metadata,
                        idempotency_key=items[i].idempotency_key,
                        ttl_seconds=items[i].ttl_seconds,
                        embedding=unit_vector(vector, f"items[{i}]"),
                        next_embedding=None if nexts is None else unit_vector(nexts[n], f"items[{i}]"),
                    )
                    for n, (i, vector) in enumerate(zip(pending, vectors, strict=True))
                ]
                stored = await self._store.insert(space.tenant, space.bucket, rows)
                stored_by_hash = {ref.content_sha256: ref for ref in stored}
                for index, digest in enumerate(hashes):
                    if resolved[index] is None:
                        ref = stored_by_hash[digest]
                        first = fresh[digest] == index and ref.inserted
                        resolved[index] = (ref.id, not first)
            span.set_attribute("tokensvc.memory.inserted", len(pending))
            return [pair for pair in resolved if pair is not None]

    async def _embed_for_migration(self, space: _Space, texts: list[str]) -> np.ndarray | None:
        """While a migration backfills the space, new memories get its target's vectors too (so
        the backfill converges however fast memories arrive). Best effort: without them, the
        migration embeds the rows itself; a Remember never fails because of the target."""
        target = space.migrating_to
        if target is None or target.name not in self._embedders.names:
            return None
        embedder = self._embedders.get(target.name)
        if embedder.spec != target:
            return None
        try:
            return await self._embed_documents(embedder, texts, space)
        except Exception as exc:  # the migration's own runner retries and reports it
            _log.warning("the migration target %s failed for a write (%s)", target.name, type(exc).__name__)
            return None

    async def _embed_documents(
        self, embedder: ScheduledEmbedder, texts: list[str], space: _Space
    ) -> np.ndarray:
        """A caller's own writes: the interactive class, in its agent's fair share."""
        demand = Demand.of(WorkClass.INTERACTIVE, space.tenant.namespace, space.tenant.agent)
        with _tracer.start_as_current_span("embed", record_exception=False) as span:
            span.set_attribute("tokensvc.embed.count", len(texts))
            return await observe_embedding(
                embedder.spec.name, embedder.embed_documents(texts, demand), texts=len(texts)
            )

    async def update(
        self,
        scope: TenantScope,
        memory_id: str,
        *,
        content: str | None,
        metadata: dict[str, MetadataScalar] | None,
        replace_metadata: bool,
        remove_keys: Sequence[str],
        ttl_seconds: int | None,
    ) -> MemoryRecord:
        return await self._fresh(
            lambda: self._update(
                scope,
                memory_id,
                content=content,
                metadata=metadata,
                replace_metadata=replace_metadata,
                remove_keys=remove_keys,
                ttl_seconds=ttl_seconds,
            ),
        )

    async def _update(
        self,
        scope: TenantScope,
        memory_id: str,
        *,
        content: str | None,
        metadata: dict[str, MetadataScalar] | None,
        replace_metadata: bool,
        remove_keys: Sequence[str],
        ttl_seconds: int | None,
    ) -> MemoryRecord:
        with _tracer.start_as_current_span("memory.update", record_exception=False) as span:
            _annotate(span, scope)
            space = await self._space(scope, for_write=False)
            current = (
                None
                if space is None
                else await self._store.get(space.tenant, space.bucket, memory_id, space.spec.name)
            )
            if space is None or current is None:
                raise NotFound("no such memory")
            new_content = None
            if content is not None:
                normalised = normalise_content(content)
                if normalised != current.content:
                    vector = (
                        await self._embed_documents(self._require_embedder(space), [normalised], space)
                    )[0]
                    new_content = (normalised, content_hash(normalised), unit_vector(vector, "content"))
            new_metadata: dict[str, Any] | None = None
            if metadata is not None or remove_keys or replace_metadata:
                merged = {} if replace_metadata else dict(current.metadata)
                merged.update(metadata or {})
                for key in remove_keys:
                    merged.pop(key, None)
                if len(merged) > MAX_METADATA_ENTRIES:
                    raise InvalidArgument(
                        "metadata",
                        f"the memory would have {len(merged)} entries; the limit is {MAX_METADATA_ENTRIES}",
                    )
                new_metadata = merged
            updated = await self._store.update(
                space.tenant,
                space.bucket,
                memory_id,
                content=new_content,
                metadata=new_metadata,
                ttl_seconds=ttl_seconds,
                embedder=space.spec.name,
            )
            if updated is None:
                raise NotFound("no such memory")
            return updated

    async def forget(self, scope: TenantScope, ids: Sequence[str]) -> int:
        with _tracer.start_as_current_span("memory.forget", record_exception=False) as span:
            _annotate(span, scope, items=len(ids))
            space = await self._space(scope, for_write=False)
            if space is None:
                return 0
            count = await self._store.delete(space.tenant, space.bucket, ids)
            span.set_attribute("tokensvc.memory.forgotten", count)
            return count

    async def forget_all(self, scope: TenantScope) -> int:
        with _tracer.start_as_current_span("memory.forget", record_exception=False) as span:
            _annotate(span, scope)
            space = await self._space(scope, for_write=False)
            tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id,))
            count = await self._store.delete_all(tenant, scope.bucket_id) if space is not None else 0
            span.set_attribute("tokensvc.memory.forgotten", count)
            return count

    # --- reads ------------------------------------------------------------------------------

    async def get(self, scope: TenantScope, memory_id: str) -> MemoryRecord:
        with _tracer.start_as_current_span("memory.get", record_exception=False) as span:
            _annotate(span, scope)
            space = await self._space(scope, for_write=False)
            record = (
                None
                if space is None
                else await self._store.get(space.tenant, space.bucket, memory_id, space.spec.name)
            )
            if record is None:
                raise NotFound("no such memory")
            return record

    async def list_page(
        self, scope: TenantScope, *, page_size: int, cursor: PageCursor | None, filter_: Filter | None
    ) -> tuple[list[MemoryRecord], MemoryRecord | None]:
        """A page, newest first, and the last record when there may be more (for the next token)."""
        with _tracer.start_as_current_span("memory.list", record_exception=False) as span:
            _annotate(span, scope)
            space = await self._space(scope, for_write=False)
            if space is None:
                return [], None
            records = await self._store.list_page(
                space.tenant,
                space.bucket,
                limit=page_size + 1,
                after=None if cursor is None else (cursor.created_at, cursor.id),
                filter_=filter_,
                embedder=space.spec.name,
            )
            span.set_attribute("tokensvc.result_count", min(len(records), page_size))
            if len(records) > page_size:
                return records[:page_size], records[page_size - 1]
            return records, None

    async def search(self, scope: TenantScope, query: SearchQuery) -> list[SearchHit]:
        """One transaction: the bucket's row count (when not cached) and the search statement."""
        with _tracer.start_as_current_span("memory.search", record_exception=False) as span:
            _annotate(span, scope)
            span.set_attribute("tokensvc.search.mode", str(query.mode))
            space = await self._space(scope, for_write=False)
            if space is None:
                return []
            vector, embedding = self._query_vector(space, query)
            retrieval = Retrieval(
                mode=query.mode,
                text=query.text,
                vector=vector,
                top_k=query.top_k,
                min_score=query.min_score,
                filtered=query.filter is not None,
                text_config=space.text_config,
                dimension=space.spec.dimension,
                embedding=embedding,
            )
            hits = await self._engine.search(
                retrieval,
                lambda plan: self._store.search(
                    space.tenant,
                    space.bucket,
                    plan,
                    count_cap=plan.count_cap,
                    filter_=query.filter,
                    embedder=space.spec.name,
                ),
            )
            span.set_attribute("tokensvc.result_count", len(hits))
            return hits

    def _query_vector(
        self, space: _Space, query: SearchQuery
    ) -> tuple[np.ndarray | None, QueryEmbedding | None]:
        """The search's vector when given, or its text to embed (neither in TEXT mode)."""
        if query.mode is SearchMode.TEXT:
            return None, None
        if query.vector is not None:
            if query.vector.shape[0] != space.spec.dimension:
                raise InvalidArgument(
                    "query_vector", f"must have {space.spec.dimension} dimensions (the pinned embedder's)"
                )
            return unit_vector(query.vector, "query_vector"), None
        assert query.text is not None
        embedder = self._require_embedder(space)
        return None, QueryEmbedding(embedder, query.text, space.tenant.namespace, space.tenant.agent)

    async def sweep_expired(self) -> int:
        total = 0
        while (deleted := await self._store.sweep_expired()) > 0:
            total += deleted
        return total


def _annotate(span: trace.Span, scope: TenantScope, **counts: int) -> None:
    # Tenant identifiers only: never content, tokens or user ids.
    span.set_attribute("tokensvc.namespace", scope.namespace)
    span.set_attribute("tokensvc.agent", scope.agent)
    span.set_attribute("tokensvc.bucket", scope.bucket_id)
    for name, value in counts.items():
        span.set_attribute(f"tokensvc.{name}", value)
