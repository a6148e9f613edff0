"""Long-term memories in process memory (the contract: `tokensvc.storage.ports.MemoryStore`).

The same semantics as `tokensvc.storage.postgres.memories`, checked by the one conformance suite
(`tests/storage/conformance/`): tenant isolation by bucket (a bucket the tenant did not declare
is invisible, and writing into it raises `PermissionError`, where PostgreSQL's row-level security
refuses), expiry, deduplication by content hash and idempotency key, newest-first paging, the
search's candidates (`tokensvc.storage.inprocess.ranking`; always exact). Text terms are
`tokensvc.storage.inprocess.text`'s `simple` words whatever the pinned configuration.

Concurrency: every write holds the store's lock from its first read to its last write, across a
scheduling point where PostgreSQL would take a round trip, so concurrent writers serialise as
PostgreSQL's unique indexes make them; a read runs without yielding, so it sees one state.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from tokensvc.errors import AlreadyExists
from tokensvc.storage.filter_language import Filter, matches
from tokensvc.storage.inprocess.clock import Clock, StoreClock
from tokensvc.storage.inprocess.ranking import Searchable, candidates
from tokensvc.storage.inprocess.text import Terms, terms_of
from tokensvc.storage.ports import StaleMemorySpace
from tokensvc.storage.records import (
    EmbedderSpec,
    MemoryRecord,
    MemorySpace,
    NewMemory,
    SearchOutcome,
    SearchPlan,
    StoredRef,
    Tenant,
)

__all__ = [
    "InProcessMemoryStatistics",
    "InProcessMemoryStore",
    "MemoryRow",
    "MemoryTables",
    "stored_vector",
    "with_vector",
]

_SWEEP_LIMITS = range(1, 10_001)  # what PostgreSQL's sweep function accepts


@dataclass(frozen=True)
class MemoryRow:
    bucket: str
    namespace: str  # the space that wrote the row (what `InProcessMemoryStatistics` counts by)
    agent: str
    id: str
    content: str
    sha: bytes
    metadata: dict[str, Any]
    key: str | None
    # The two vector slots (PostgreSQL's embedding and embedding_b): the space's generation picks one.
    slots: tuple[np.ndarray | None, np.ndarray | None]
    terms: Terms
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None

    def live(self, now: datetime) -> bool:
        return self.expires_at is None or self.expires_at > now

    def record(self, embedder: str) -> MemoryRecord:
        return MemoryRecord(
            id=self.id,
            content=self.content,
            metadata=dict(self.metadata),
            created_at=self.created_at,
            updated_at=self.updated_at,
            expires_at=self.expires_at,
            embedder=embedder,
        )

    def ref(self, *, inserted: bool) -> StoredRef:
        return StoredRef(self.id, self.sha, self.key, inserted=inserted)


def _uuid(value: str) -> str:
    """The canonical form of a memory id (PostgreSQL's `uuid` type: any case in, lowercase out)."""
    return str(uuid.UUID(value))


def stored_vector(embedding: np.ndarray) -> np.ndarray:
    """A private float32 copy (pgvector stores single precision)."""
    stored = np.array(embedding, dtype=np.float32)
    stored.setflags(write=False)
    return stored


def _slot(tenant: Tenant) -> int:
    return (tenant.generation or 0) % 2


def with_vector(
    slots: tuple[np.ndarray | None, np.ndarray | None], slot: int, vector: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    return (vector, slots[1]) if slot == 0 else (slots[0], vector)


async def _round_trip() -> None:
    """Where PostgreSQL would wait for the database: other tasks may run here."""
    await asyncio.sleep(0)


@dataclass
class MemoryTables:
    """The memories' tables, as PostgreSQL's are: what every in-process store that reads or writes
    memories shares (this module's stores, the re-embedding and data-subject stores), under one
    lock; the stores' methods hold the semantics."""

    clock: StoreClock
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rows: dict[str, dict[str, MemoryRow]] = field(
        default_factory=dict
    )  # bucket -> id -> row, in insertion order
    spaces: dict[tuple[str, str], MemorySpace] = field(default_factory=dict)
    # Backfilling migrations' targets by space (kept by InProcessEmbeddingMigrationStore).
    migrating: dict[tuple[str, str], tuple[str, EmbedderSpec]] = field(default_factory=dict)


class InProcessMemoryStore:
    """`MemoryStore` over dictionaries; `clock` is the wall clock (tests may move it forward)."""

    def __init__(self, clock: Clock | None = None):
        self.tables = MemoryTables(StoreClock(clock))

    def _bucket(self, tenant: Tenant, bucket: str) -> dict[str, MemoryRow]:
        """The bucket's rows, or nothing when the tenant did not declare it (row-level security)."""
        return self.tables.rows.get(bucket, {}) if bucket in tenant.buckets else {}

    def _writable(self, tenant: Tenant, bucket: str) -> dict[str, MemoryRow]:
        if bucket not in tenant.buckets:
            raise PermissionError("the bucket is outside the tenant's declared buckets")
        return self.tables.rows.setdefault(bucket, {})

    def _guard(self, tenant: Tenant) -> bool:
        """PostgreSQL's generation guard, for a row about to be written: refuse a generation that
        is gone (`StaleMemorySpace`); whether the row may keep a vector in the other slot."""
        if tenant.generation is None:
            return True
        key = (tenant.namespace, tenant.agent)
        space = self.tables.spaces.get(key)
        if space is None or space.generation != tenant.generation:
            raise StaleMemorySpace()
        migrating = self.tables.migrating.get(key)
        return migrating is not None and migrating[0] == tenant.dual_write

    # --- memory spaces ----------------------------------------------------------------------

    async def get_space(self, tenant: Tenant) -> MemorySpace | None:
        key = (tenant.namespace, tenant.agent)
        space = self.tables.spaces.get(key)
        if space is None:
            return None
        migrating = self.tables.migrating.get(key)
        if migrating is None:
            return space
        return replace(space, migration_id=migrating[0], migrating_to=migrating[1])

    async def pin_space(self, tenant: Tenant, space: MemorySpace) -> MemorySpace:
        """Pin `space` unless one is pinned; every dimension can be searched (exactly) here."""
        return self.tables.spaces.setdefault((tenant.namespace, tenant.agent), space)

    # --- writes -----------------------------------------------------------------------------

    async def move_buckets(self, tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        async with self.tables.lock:
            now = self.tables.clock.now()
            buckets = [b for b in (target, *sources) if b in tenant.buckets]
            if target not in buckets:
                return 0
            # Expired rows are dead: an expired target row must not make a live source row a
            # duplicate, and expired source rows do not move.
            for bucket in buckets:
                table = self.tables.rows.get(bucket, {})
                for row in [r for r in table.values() if not r.live(now)]:
                    del table[row.id]
            into = self.tables.rows.setdefault(target, {})
            moved = 0
            for source in dict.fromkeys(buckets[1:]):
                if source == target:
                    continue
                shas = {row.sha for row in into.values()}
                keys = {row.key for row in into.values() if row.key is not None}
                leaving = list(self.tables.rows.get(source, {}).values())
                await _round_trip()
                self.tables.rows.pop(source, None)
                for row in leaving:
                    if row.sha in shas or (row.key is not None and row.key in keys):
                        continue
                    into[row.id] = replace(row, bucket=target)
                    moved += 1
            return moved

    async def find_existing(
        self, tenant: Tenant, bucket: str, hashes: Sequence[bytes], keys: Sequence[str]
    ) -> list[StoredRef]:
        now = self.tables.clock.now()
        wanted_hashes, wanted_keys = set(hashes), set(keys)
        return [
            row.ref(inserted=False)
            for row in self._bucket(tenant, bucket).values()
            if row.live(now)
            and (row.sha in wanted_hashes or (row.key is not None and row.key in wanted_keys))
        ]

    async def insert(self, tenant: Tenant, bucket: str, rows: Sequence[NewMemory]) -> list[StoredRef]:
        """All-or-nothing; a row whose content, key or id is already live in the bucket (or
        earlier in the batch) is skipped and the live row matching it reported, like PostgreSQL's
        `INSERT ... ON CONFLICT DO NOTHING`; a skipped row whose content no reported row has
        (its key belongs to other content) fails the whole batch with `AlreadyExists`."""
        if len({int(row.embedding.shape[0]) for row in rows}) > 1:
            raise ValueError("every row of an insert has the dimension of the first")
        async with self.tables.lock:
            table = self._writable(tenant, bucket)
            now = self.tables.clock.now()
            live = [row for row in table.values() if row.live(now)]
            ids = {row.id for row in live}
            shas = {row.sha for row in live}
            keys = {row.key for row in live if row.key is not None}
            fresh: list[NewMemory] = []
            for new in rows:
                new_id = _uuid(new.id)
                if new_id in ids or new.content_sha256 in shas or (new.idempotency_key or None) in keys:
                    continue
                fresh.append(new)
                ids.add(new_id)
                shas.add(new.content_sha256)
                if new.idempotency_key:
                    keys.add(new.idempotency_key)
            done = {new.content_sha256 for new in fresh}
            missing = [new for new in rows if new.content_sha256 not in done]
            missing_shas = {new.content_sha256 for new in missing}
            missing_keys = {new.idempotency_key for new in missing if new.idempotency_key}
            existing = [
                row.ref(inserted=False)
                for row in live
                if row.sha in missing_shas or (row.key is not None and row.key in missing_keys)
            ]
            if missing_shas - {ref.content_sha256 for ref in existing}:
                raise AlreadyExists("an idempotency key of this request is used for different content")
            await _round_trip()  # what was read above must still hold below: the lock sees to it
            # Expired rows with these contents or keys would block a re-insert in PostgreSQL: gone.
            for row in [r for r in table.values() if not r.live(now)]:
                if any(
                    row.sha == new.content_sha256 or (row.key and row.key == new.idempotency_key)
                    for new in rows
                ):
                    del table[row.id]
            refs = []
            keep_other = self._guard(tenant) if fresh else False
            for new in fresh:
                at = self.tables.clock.now()
                row = MemoryRow(
                    bucket=bucket,
                    namespace=tenant.namespace,
                    agent=tenant.agent,
                    id=_uuid(new.id),
                    content=new.content,
                    sha=new.content_sha256,
                    metadata=dict(new.metadata),
                    key=new.idempotency_key or None,
                    slots=with_vector(
                        with_vector(
                            (None, None),
                            1 - _slot(tenant),
                            None
                            if new.next_embedding is None or not keep_other
                            else stored_vector(new.next_embedding),
                        ),
                        _slot(tenant),
                        stored_vector(new.embedding),
                    ),
                    terms=terms_of(new.content),
                    created_at=at,
                    updated_at=at,
                    expires_at=None if new.ttl_seconds is None else at + timedelta(seconds=new.ttl_seconds),
                )
                table[row.id] = row
                refs.append(row.ref(inserted=True))
            return refs + existing

    async def update(
        self,
        tenant: Tenant,
        bucket: str,
        memory_id: str,
        *,
        content: tuple[str, bytes, np.ndarray] | None,
        metadata: dict[str, Any] | None,
        ttl_seconds: int | None,
        embedder: str,
    ) -> MemoryRecord | None:
        async with self.tables.lock:
            now = self.tables.clock.now()
            table = self._bucket(tenant, bucket)
            row = table.get(_uuid(memory_id))
            if row is None or not row.live(now):
                return None
            self._guard(tenant)
            changes: dict[str, Any] = {"updated_at": self.tables.clock.now()}
            if content is not None:
                text, sha, vector = content
                if any(
                    other.sha == sha and other.id != row.id and other.live(now) for other in table.values()
                ):
                    raise AlreadyExists("another memory in this bucket has this content", field="content")
                changes |= {
                    "content": text,
                    "sha": sha,
                    # The other slot held a vector of the old content (PostgreSQL's guard clears
                    # it for a tenant's write of new content).
                    "slots": with_vector(
                        row.slots if tenant.generation is None or text == row.content else (None, None),
                        _slot(tenant),
                        stored_vector(vector),
                    ),
                    "terms": terms_of(text),
                }
            if metadata is not None:
                changes["metadata"] = dict(metadata)
            if ttl_seconds is not None:
                changes["expires_at"] = now + timedelta(seconds=ttl_seconds)
            await _round_trip()
            updated = replace(row, **changes)
            table[row.id] = updated
            return updated.record(embedder)

    async def delete(self, tenant: Tenant, bucket: str, ids: Sequence[str]) -> int:
        async with self.tables.lock:
            now = self.tables.clock.now()
            table = self._bucket(tenant, bucket)
            doomed = {_uuid(i) for i in ids} & {row.id for row in table.values() if row.live(now)}
            for memory_id in doomed:
                del table[memory_id]
            return len(doomed)

    async def delete_all(self, tenant: Tenant, bucket: str) -> int:
        """Every row of the bucket goes, expired ones too; the live ones are counted."""
        async with self.tables.lock:
            now = self.tables.clock.now()
            live = sum(row.live(now) for row in self._bucket(tenant, bucket).values())
            if bucket in tenant.buckets:
                self.tables.rows.pop(bucket, None)
            return live

    async def sweep_expired(self, limit: int = 1000) -> int:
        if limit not in _SWEEP_LIMITS:
            raise ValueError("sweep limit must be between 1 and 10000")
        async with self.tables.lock:
            now = self.tables.clock.now()
            deleted = 0
            for table in self.tables.rows.values():
                for row in [r for r in table.values() if not r.live(now)][: limit - deleted]:
                    del table[row.id]
                    deleted += 1
            return deleted

    # --- reads ------------------------------------------------------------------------------

    async def get(self, tenant: Tenant, bucket: str, memory_id: str, embedder: str) -> MemoryRecord | None:
        row = self._bucket(tenant, bucket).get(_uuid(memory_id))
        return row.record(embedder) if row is not None and row.live(self.tables.clock.now()) else None

    async def list_page(
        self,
        tenant: Tenant,
        bucket: str,
        *,
        limit: int,
        after: tuple[datetime, str] | None,
        filter_: Filter | None,
        embedder: str,
    ) -> list[MemoryRecord]:
        rows = self._searchable(tenant, bucket, filter_)
        if after is not None:
            cursor = (after[0], _uuid(after[1]))
            rows = [row for row in rows if (row.created_at, row.id) < cursor]
        rows.sort(key=lambda row: (row.created_at, row.id), reverse=True)
        return [row.record(embedder) for row in rows[:limit]]

    def _searchable(self, tenant: Tenant, bucket: str, filter_: Filter | None) -> list[MemoryRow]:
        now = self.tables.clock.now()
        return [
            row
            for row in self._bucket(tenant, bucket).values()
            if row.live(now) and (filter_ is None or matches(filter_, row.metadata))
        ]

    async def search(
        self,
        tenant: Tenant,
        bucket: str,
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        count_cap: int,
        filter_: Filter | None,
        embedder: str,
    ) -> SearchOutcome[MemoryRecord]:
        """Counts like PostgreSQL: the bucket's rows up to `count_cap`, expired rows not swept yet
        included and the filter not applied (the count routes and weighs terms)."""
        if row_count is None:
            row_count = min(count_cap, len(self._bucket(tenant, bucket)))
        query = plan(row_count)
        # The rows as they are now, before a pending vector is awaited: one snapshot, as PostgreSQL.
        indexed = list(_indexed(self._searchable(tenant, bucket, filter_), embedder, _slot(tenant)))
        found = candidates(indexed, await query.with_vector())
        return SearchOutcome(query.row_count, found)


def _indexed(rows: Iterable[MemoryRow], embedder: str, slot: int) -> Iterable[Searchable[MemoryRecord]]:
    # A memory's neighbours are the bucket's memories created just before and after it.
    for row in rows:
        vector = row.slots[slot]
        if vector is None:
            continue  # never for a live row: its space's slot is always filled
        yield Searchable(
            item=row.record(embedder),
            key=(row.bucket, row.id),
            partition=(row.bucket,),
            order=(row.created_at, row.id),
            local=row.id,
            embedding=vector,
            terms=row.terms,
        )


class InProcessMemoryStatistics:
    """`MemoryStatistics` over the rows of one `InProcessMemoryStore`: every bucket of every tenant
    (counts only), live rows alone. A row counts for the pepper version of the bucket it is in now
    (`v<N>.<...>`) and for the space (namespace, agent) that wrote it, as PostgreSQL's columns say."""

    def __init__(self, store: InProcessMemoryStore):
        self._store = store

    def _live(self) -> Iterator[MemoryRow]:
        store = self._store
        now = store.tables.clock.now()
        for table in store.tables.rows.values():
            yield from (row for row in table.values() if row.live(now))

    async def rows_by_pepper_version(self) -> dict[int, int]:
        counts = Counter(int(row.bucket[1:].split(".", 1)[0]) for row in self._live())
        return dict(sorted(counts.items()))

    async def rows_by_space(self) -> dict[tuple[str, str], int]:
        counts = Counter((row.namespace, row.agent) for row in self._live())
        return dict(sorted(counts.items()))
