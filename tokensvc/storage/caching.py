"""Store decorators that cache: each implements its port by wrapping another implementation of it.

Caches around stores live here, composed by the composition root (the SpiceDB habit: its
`proxy/caching.go` wraps a datastore), never inside a domain service. What they keep, per replica:

- `CachingMemoryStore`: a memory space's pin (`get_space`), for `pin_seconds`; and a bucket's
  row count (which routes a search and sizes BM25's N), for `row_count_seconds`.
- `CachingKnowledgeStore`: the bases a launcher's search plans with (`bases_for_search`), checked
  by the search's own transaction (`expect`), and the searched bases' row count; both for
  `seconds`.

A stale entry costs a retry or some speed, never a wrong result: a write with a stale pin is
refused by the store (`StaleMemorySpace`) and forgets the pin; a stale knowledge-base pin fails its
search's check (`StaleKnowledgeBases`) and is forgotten; a stale row count only routes a search
less well (see `RowCounts`).

A call a decorator only passes on takes the port's keyword arguments as they come (`**page`): the
port's signature is the contract, and callers are typed against the port.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from tokensvc.errors import ConcurrentChange
from tokensvc.storage.ports import KnowledgeStore, MemoryStore, StaleKnowledgeBases, StaleMemorySpace
from tokensvc.storage.records import (
    BaseRow,
    DocumentRow,
    KnowledgePins,
    MemoryRecord,
    MemorySpace,
    NewMemory,
    PassageRow,
    SearchOutcome,
    SearchPlan,
    StoredRef,
    Tenant,
)

__all__ = [
    "PIN_CAPACITY",
    "ROW_COUNT_SECONDS",
    "CachingKnowledgeStore",
    "CachingMemoryStore",
    "Recent",
    "RowCounts",
]

T = TypeVar("T")

# How long a row count (which routes searches and sizes BM25's idf) and a knowledge search's bases
# are reused.
ROW_COUNT_SECONDS = 30.0
# Memory-space pins kept at once (the oldest read is dropped first).
PIN_CAPACITY = 10_000


class Recent(Generic[T]):
    """Values kept for `ttl` seconds of `clock` (at most `capacity`, the least recently put
    dropped first)."""

    def __init__(self, ttl: float, capacity: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self._ttl = ttl
        self._capacity = capacity
        self._clock = clock
        self._entries: dict[str, tuple[T, float]] = {}

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def put(self, key: str, value: T) -> None:
        self._entries.pop(key, None)
        if len(self._entries) >= self._capacity:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (value, self._clock() + self._ttl)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()


class RowCounts(Recent[int]):
    """Row counts of buckets or corpora (capped), reused for a while: they route searches and weigh
    BM25 terms, never decide results.

    A stale count costs speed, never completeness: a grown bucket searched exactly is still exact,
    and a shrunk one searched by HNSW falls back to an exact scan when the approximate one is short.
    Writes made through this replica's decorator adjust the count at once; other replicas' after
    the TTL.
    """

    def grew(self, key: str, rows: int) -> None:
        if (entry := self._entries.get(key)) is not None:
            self._entries[key] = (max(0, entry[0] + rows), entry[1])

    def filled(self, key: str, row_count: int | None) -> int | None:
        """The caller's count when it has one, else the remembered one (None: the store counts)."""
        return row_count if row_count is not None else self.get(key)


def _space_key(tenant: Tenant) -> str:
    return f"{tenant.namespace}/{tenant.agent}"


def _bases_key(namespace: str, refs: Sequence[str]) -> str:
    return f"{namespace}/{','.join(refs)}"


class CachingMemoryStore:
    """A `MemoryStore` that remembers pins and bucket row counts of the store it wraps.

    A pin is reused for `pin_seconds` (a pin changes only at a re-embedding cutover, whose old
    vectors stay searchable for longer than that) and forgotten when a call of its space is refused
    as stale (`StaleMemorySpace`) or rolled back for a conflict (`ConcurrentChange`: on Citus a
    cutover can deadlock with a write), so the caller's retry reads it afresh. A bucket's count is
    adjusted by this replica's inserts and deletes and forgotten when the bucket is emptied or rows
    are moved into it.
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        pin_seconds: float,
        row_count_seconds: float = ROW_COUNT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self._pins: Recent[MemorySpace] = Recent(pin_seconds, PIN_CAPACITY, clock)
        self._counts = RowCounts(row_count_seconds, clock=clock)

    @contextmanager
    def _refusals(self, tenant: Tenant) -> Iterator[None]:
        try:
            yield
        except (StaleMemorySpace, ConcurrentChange):
            self._pins.forget(_space_key(tenant))
            raise

    async def get_space(self, tenant: Tenant) -> MemorySpace | None:
        if (pinned := self._pins.get(_space_key(tenant))) is not None:
            return pinned
        with self._refusals(tenant):
            pinned = await self._store.get_space(tenant)
        if pinned is not None:  # a space not pinned yet is asked again: its first write pins it
            self._pins.put(_space_key(tenant), pinned)
        return pinned

    async def pin_space(self, tenant: Tenant, space: MemorySpace) -> MemorySpace:
        with self._refusals(tenant):
            pinned = await self._store.pin_space(tenant, space)
        self._pins.put(_space_key(tenant), pinned)
        return pinned

    async def move_buckets(self, tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        with self._refusals(tenant):
            moved = await self._store.move_buckets(tenant, target, sources)
        self._counts.forget(target)
        return moved

    async def find_existing(
        self, tenant: Tenant, bucket: str, hashes: Sequence[bytes], keys: Sequence[str]
    ) -> list[StoredRef]:
        with self._refusals(tenant):
            return await self._store.find_existing(tenant, bucket, hashes, keys)

    async def insert(self, tenant: Tenant, bucket: str, rows: Sequence[NewMemory]) -> list[StoredRef]:
        with self._refusals(tenant):
            stored = await self._store.insert(tenant, bucket, rows)
        self._counts.grew(bucket, sum(ref.inserted for ref in stored))
        return stored

    async def update(
        self, tenant: Tenant, bucket: str, memory_id: str, **changes: Any
    ) -> MemoryRecord | None:
        with self._refusals(tenant):
            return await self._store.update(tenant, bucket, memory_id, **changes)

    async def delete(self, tenant: Tenant, bucket: str, ids: Sequence[str]) -> int:
        with self._refusals(tenant):
            count = await self._store.delete(tenant, bucket, ids)
        self._counts.grew(bucket, -count)
        return count

    async def delete_all(self, tenant: Tenant, bucket: str) -> int:
        with self._refusals(tenant):
            count = await self._store.delete_all(tenant, bucket)
        self._counts.forget(bucket)
        return count

    async def sweep_expired(self, limit: int = 1000) -> int:
        return await self._store.sweep_expired(limit)

    async def get(self, tenant: Tenant, bucket: str, memory_id: str, embedder: str) -> MemoryRecord | None:
        with self._refusals(tenant):
            return await self._store.get(tenant, bucket, memory_id, embedder)

    async def list_page(self, tenant: Tenant, bucket: str, **page: Any) -> list[MemoryRecord]:
        with self._refusals(tenant):
            return await self._store.list_page(tenant, bucket, **page)

    async def search(
        self, tenant: Tenant, bucket: str, plan: SearchPlan, *, row_count: int | None = None, **search: Any
    ) -> SearchOutcome[MemoryRecord]:
        known = self._counts.filled(bucket, row_count)
        with self._refusals(tenant):
            outcome = await self._store.search(tenant, bucket, plan, row_count=known, **search)
        if known is None:
            self._counts.put(bucket, outcome.row_count)
        return outcome


class CachingKnowledgeStore:
    """A `KnowledgeStore` that remembers, for `seconds`, the bases each launcher search planned
    with and the row counts of the bases it searched.

    Remembered bases are answered with the pins their search must check (`bases_for_search`); a
    search whose check fails forgets them, so the caller's next `bases_for_search` reads them
    afresh. Creating or deleting a base forgets every remembered search's bases.
    """

    def __init__(
        self,
        store: KnowledgeStore,
        *,
        seconds: float = ROW_COUNT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self._bases: Recent[list[BaseRow]] = Recent(seconds, clock=clock)
        self._counts = RowCounts(seconds, clock=clock)

    async def create_base(self, tenant: Tenant, base: BaseRow) -> tuple[BaseRow, bool]:
        stored, created = await self._store.create_base(tenant, base)
        if created:
            self._bases.clear()
        return stored, created

    async def get_bases(self, tenant: Tenant, refs: Sequence[str]) -> list[BaseRow]:
        return await self._store.get_bases(tenant, refs)

    async def bases_for_search(
        self, tenant: Tenant, refs: Sequence[str]
    ) -> tuple[list[BaseRow], KnowledgePins | None]:
        key = _bases_key(tenant.namespace, refs)
        remembered = self._bases.get(key)
        if remembered is not None:
            held = tuple((b.ref, b.created_at, b.generation) for b in remembered)
            return remembered, KnowledgePins(tuple(refs), held)
        bases, expect = await self._store.bases_for_search(tenant, refs)
        if expect is None:  # read just now: what later searches check
            self._bases.put(key, bases)
        return bases, expect

    async def list_bases(self, tenant: Tenant, **page: Any) -> list[BaseRow]:
        return await self._store.list_bases(tenant, **page)

    async def delete_base(self, tenant: Tenant, ref: str) -> int | None:
        count = await self._store.delete_base(tenant, ref)
        self._bases.clear()
        return count

    async def document_state(
        self, tenant: Tenant, kb_ref: str, doc_ref: str
    ) -> tuple[BaseRow | None, DocumentRow | None]:
        return await self._store.document_state(tenant, kb_ref, doc_ref)

    async def document_text(self, tenant: Tenant, kb_ref: str, doc_ref: str, version: int) -> str | None:
        return await self._store.document_text(tenant, kb_ref, doc_ref, version)

    async def list_documents(self, tenant: Tenant, kb_ref: str, **page: Any) -> list[DocumentRow] | None:
        return await self._store.list_documents(tenant, kb_ref, **page)

    async def replace_document(self, tenant: Tenant, **version: Any) -> tuple[DocumentRow, bool] | None:
        return await self._store.replace_document(tenant, **version)

    async def delete_document(self, tenant: Tenant, kb_ref: str, ref: str) -> int | None:
        return await self._store.delete_document(tenant, kb_ref, ref)

    async def search(
        self,
        tenant: Tenant,
        kb_refs: Sequence[str],
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        expect: KnowledgePins | None = None,
        **search: Any,
    ) -> SearchOutcome[PassageRow]:
        key = _bases_key(tenant.namespace, kb_refs)
        known = self._counts.filled(key, row_count)
        try:
            outcome = await self._store.search(
                tenant, kb_refs, plan, row_count=known, expect=expect, **search
            )
        except StaleKnowledgeBases:
            if expect is not None:
                self._bases.forget(_bases_key(tenant.namespace, expect.roster))
            raise
        if known is None:
            self._counts.put(key, outcome.row_count)
        return outcome
