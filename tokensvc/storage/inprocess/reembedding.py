"""Re-embedding migrations in process memory (the contract:
`tokensvc.storage.ports.EmbeddingMigrationStore`), over the tables of one `InProcessMemoryStore`
and one `InProcessKnowledgeStore` (`MemoryTables`, `KnowledgeTables`: shared state, as PostgreSQL's
tables are shared by its stores; no store's private names).

The same semantics as `tokensvc.storage.postgres.reembedding`, checked by the conformance suite:
one active migration per space, leases with expiry, batches in (bucket, id) order after a
cursor, the cutover only when every live memory has a target vector. Rows are visited in
code-point order of (bucket, id), which is PostgreSQL's order under the C collation; the suite
relies on the order being total and consistent, not on which one it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TypeVar

import numpy as np

from tokensvc.storage.inprocess.knowledge import DocumentVersion, InProcessKnowledgeStore, stored_chunk
from tokensvc.storage.inprocess.ledgers import InProcessAuditStore
from tokensvc.storage.inprocess.memories import InProcessMemoryStore, MemoryRow, stored_vector, with_vector
from tokensvc.storage.records import ChunkRow, StoredChunk
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
    PendingDocument,
    PendingMemory,
)

__all__ = ["InProcessEmbeddingMigrationStore"]

_M = TypeVar("_M", bound=EmbeddingMigration)


class InProcessEmbeddingMigrationStore:
    def __init__(
        self,
        memories: InProcessMemoryStore,
        audit: InProcessAuditStore | None = None,
        knowledge: InProcessKnowledgeStore | None = None,
    ):
        self._memories = memories
        self._knowledge = knowledge or InProcessKnowledgeStore()
        self._knowledge.tables.base_deleted.append(self._base_deleted)
        self._audit = audit or InProcessAuditStore()  # where the cutover's audit event goes
        self._migrations: dict[str, EmbeddingMigration] = {}
        self._leases: dict[str, datetime] = {}

    def _now(self) -> datetime:
        return self._memories.tables.clock.now()

    def _space_rows(self, migration: MemorySpaceMigration) -> Iterator[MemoryRow]:
        for table in self._memories.tables.rows.values():
            for row in table.values():
                if (row.namespace, row.agent) == (migration.namespace, migration.agent):
                    yield row

    def _ordered(self, migration: MemorySpaceMigration) -> list[MemoryRow]:
        rows = sorted(self._space_rows(migration), key=lambda row: (row.bucket, row.id))
        if migration.cursor is None:
            return rows
        return [row for row in rows if (row.bucket, row.id) > migration.cursor]

    def _held(self, migration: _M, runner: str) -> _M | None:
        """The stored migration, of `migration`'s kind, when `runner` holds its unexpired lease."""
        stored = self._migrations.get(migration.id)
        if (
            not isinstance(stored, type(migration))
            or stored.lease_owner != runner
            or self._leases.get(stored.id, self._now()) < self._now()
        ):
            return None
        return stored

    def _save(self, migration: _M) -> _M:
        saved = replace(migration, updated_at=self._now())
        self._migrations[saved.id] = saved
        match saved:
            case KnowledgeBaseMigration():
                base = (saved.namespace, saved.kb_ref)
                if saved.state is MigrationState.BACKFILLING:
                    self._knowledge.tables.migrating[base] = (saved.id, saved.target, saved.target_chunking)
                elif self._knowledge.tables.migrating.get(base, ("",))[0] == saved.id:
                    del self._knowledge.tables.migrating[base]
            case MemorySpaceMigration():
                key = (saved.namespace, saved.agent)
                if saved.state is MigrationState.BACKFILLING:
                    self._memories.tables.migrating[key] = (saved.id, saved.target)
                elif self._memories.tables.migrating.get(key, ("",))[0] == saved.id:
                    del self._memories.tables.migrating[key]
        return saved

    def _base_deleted(self, namespace: str, kb_ref: str) -> None:
        """The knowledge base is gone, and its unfinished migration with it."""
        for migration in list(self._migrations.values()):
            if (
                isinstance(migration, KnowledgeBaseMigration)
                and (migration.namespace, migration.kb_ref) == (namespace, kb_ref)
                and migration.state.active
            ):
                self._leases.pop(migration.id, None)
                self._save(
                    replace(
                        migration,
                        state=MigrationState.CANCELLED,
                        reason="the knowledge base was deleted",
                        lease_owner=None,
                        finished_at=self._now(),
                    )
                )

    async def create(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        match migration:
            case MemorySpaceMigration():
                return await self._create_for_space(migration)
            case KnowledgeBaseMigration():
                return await self._create_for_base(migration)

    def _unfinished(self, migration: EmbeddingMigration) -> bool:
        """Another migration of the same subject is active."""
        return any(m.subject == migration.subject and m.state.active for m in self._migrations.values())

    async def _create_for_space(self, migration: MemorySpaceMigration) -> EmbeddingMigration | None:
        async with self._memories.tables.lock:
            space = self._memories.tables.spaces.get((migration.namespace, migration.agent))
            if space is None or space.generation != migration.from_generation:
                return None
            if self._unfinished(migration):
                return None
            now = self._now()
            created = replace(
                migration,
                id=str(uuid.UUID(migration.id)),
                state=MigrationState.BACKFILLING,
                rows_done=0,
                failures=0,
                lease_owner=None,
                reason="",
                created_at=now,
                cursor=None,
            )
            return self._save(created)

    async def _create_for_base(self, migration: KnowledgeBaseMigration) -> EmbeddingMigration | None:
        async with self._memories.tables.lock, self._knowledge.tables.lock:
            base = self._knowledge.tables.bases.get((migration.namespace, migration.kb_ref))
            if base is None or base.generation != migration.from_generation:
                return None
            if self._unfinished(migration):
                return None
            documents = self._base_documents(migration)
            for doc_key, version in documents:
                self._knowledge.tables.documents[doc_key] = replace(version, migrated_chunk_count=None)
            return self._save(
                replace(
                    migration,
                    id=str(uuid.UUID(migration.id)),
                    state=MigrationState.BACKFILLING,
                    rows_total=len(documents),
                    rows_done=0,
                    failures=0,
                    lease_owner=None,
                    reason="",
                    created_at=self._now(),
                    document_cursor=None,
                )
            )

    def _base_documents(
        self, migration: KnowledgeBaseMigration
    ) -> list[tuple[tuple[str, str, str], DocumentVersion]]:
        """The base's documents in ref order (code points: PostgreSQL's C collation)."""
        return sorted(
            (
                (key, version)
                for key, version in self._knowledge.tables.documents.items()
                if key[:2] == (migration.namespace, migration.kb_ref)
            ),
            key=lambda item: item[0][2],
        )

    async def get(self, migration_id: str) -> EmbeddingMigration | None:
        return self._migrations.get(str(uuid.UUID(migration_id)))

    async def page(self, *, limit: int, before: tuple[datetime, str] | None) -> list[EmbeddingMigration]:
        ordered = sorted(self._migrations.values(), key=lambda m: (m.created_at, m.id), reverse=True)
        if before is not None:
            ordered = [m for m in ordered if (m.created_at, m.id) < before]
        return ordered[:limit]

    async def active(self) -> list[EmbeddingMigration]:
        return sorted(
            (m for m in self._migrations.values() if m.state.active), key=lambda m: (m.created_at, m.id)
        )

    async def transition(
        self, migration_id: str, *, expect: Sequence[MigrationState], state: MigrationState, reason: str = ""
    ) -> EmbeddingMigration | None:
        async with self._memories.tables.lock:
            stored = self._migrations.get(str(uuid.UUID(migration_id)))
            if stored is None or stored.state not in expect:
                return None
            finished = state in (MigrationState.SUCCEEDED, MigrationState.CANCELLED)
            self._leases.pop(stored.id, None)
            moved = replace(
                stored,
                state=state,
                reason=reason,
                failures=0,
                lease_owner=None,
                finished_at=self._now() if finished else None,
            )
            # A cancel empties the target slot from the start.
            return self._save(moved.rewound() if state is MigrationState.CANCELLING else moved)

    async def claim(
        self,
        runner: str,
        *,
        lease_seconds: float,
        embedders: Sequence[str],
        retire_after_seconds: float,
        busy: Collection[str] = (),
    ) -> EmbeddingMigration | None:
        async with self._memories.tables.lock:
            now = self._now()
            for migration in sorted(self._migrations.values(), key=lambda m: (m.created_at, m.id)):
                if not migration.state.runnable or migration.id in busy:
                    continue
                if migration.state is MigrationState.BACKFILLING and migration.target.name not in embedders:
                    continue
                if migration.state is MigrationState.RETIRING and (
                    migration.cut_over_at is None
                    or migration.cut_over_at + timedelta(seconds=retire_after_seconds) > now
                ):
                    continue
                lease = self._leases.get(migration.id)
                if migration.lease_owner not in (None, runner) and lease is not None and lease >= now:
                    continue
                self._leases[migration.id] = now + timedelta(seconds=lease_seconds)
                return self._save(replace(migration, lease_owner=runner))
            return None

    async def space_size(self, namespace: str, agent: str) -> tuple[int, int]:
        now = self._now()
        lengths = [
            len(row.content)
            for table in self._memories.tables.rows.values()
            for row in table.values()
            if (row.namespace, row.agent) == (namespace, agent) and row.live(now)
        ]
        return len(lengths), round(sum(lengths) / len(lengths)) if lengths else 0

    async def pending(self, migration: MemorySpaceMigration, *, limit: int) -> list[PendingMemory]:
        held = self._held(migration, migration.lease_owner or "")
        if held is None or held.state is not MigrationState.BACKFILLING:
            return []
        now = self._now()
        slot = migration.target_slot
        out = []
        for row in self._ordered(migration):
            vector = row.slots[slot]
            if row.live(now) and (vector is None or vector.shape[0] != migration.target.dimension):
                out.append(PendingMemory(row.bucket, row.id, row.content, row.sha))
                if len(out) == limit:
                    break
        return out

    async def store_vectors(
        self,
        migration: MemorySpaceMigration,
        runner: str,
        rows: Sequence[tuple[PendingMemory, np.ndarray]],
        *,
        lease_seconds: float,
    ) -> MemorySpaceMigration | None:
        async with self._memories.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not MigrationState.BACKFILLING:
                return None
            written = 0
            for pending, vector in rows:
                table = self._memories.tables.rows.get(pending.bucket, {})
                row = table.get(pending.id)
                if row is None or row.sha != pending.content_sha256:
                    continue
                table[row.id] = replace(
                    row, slots=with_vector(row.slots, stored.target_slot, stored_vector(vector))
                )
                written += 1
            self._leases[stored.id] = self._now() + timedelta(seconds=lease_seconds)
            done = stored.rows_done + written
            return self._save(
                replace(
                    stored,
                    rows_done=done,
                    rows_total=max(stored.rows_total, done),
                    failures=0,
                    reason="",
                    cursor=(rows[-1][0].bucket, rows[-1][0].id) if rows else stored.cursor,
                )
            )

    async def renew(self, migration: EmbeddingMigration, runner: str, *, lease_seconds: float) -> bool:
        async with self._memories.tables.lock:
            stored = self._migrations.get(migration.id)
            if stored is None or stored.lease_owner != runner or not stored.state.runnable:
                return False
            self._leases[stored.id] = self._now() + timedelta(seconds=lease_seconds)
            return True

    async def rewind(self, migration: EmbeddingMigration, runner: str) -> bool:
        async with self._memories.tables.lock:
            stored = self._held(migration, runner)
            if stored is None:
                return False
            self._save(stored.rewound())
            return True

    async def cut_over(self, migration: EmbeddingMigration, runner: str) -> bool:
        match migration:
            case MemorySpaceMigration():
                return await self._cut_over_space(migration, runner)
            case KnowledgeBaseMigration():
                return await self._cut_over_base(migration, runner)

    async def _cut_over_space(self, migration: MemorySpaceMigration, runner: str) -> bool:
        async with self._memories.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not MigrationState.BACKFILLING:
                return False
            key = (stored.namespace, stored.agent)
            space = self._memories.tables.spaces[key]
            if space.generation != stored.from_generation:
                raise RuntimeError("the memory space moved on without this migration")
            now = self._now()
            for row in self._space_rows(stored):
                vector = row.slots[stored.target_slot]
                if row.live(now) and (vector is None or vector.shape[0] != stored.target.dimension):
                    return False
            self._memories.tables.spaces[key] = replace(
                space, embedder=stored.target, generation=stored.from_generation + 1
            )
            self._save(replace(stored, state=MigrationState.RETIRING, cut_over_at=now, cursor=None))
            await self._audit.append(
                kind="embedding_migration",
                actor="system:tokensvc",
                action="cut over embedding migration",
                target=f"migration:{stored.id} space:{stored.namespace}/{stored.agent}",
                outcome="succeeded",
                reason="",
                detail=f"the space now reads {stored.target.name} ({stored.target.dimension})",
            )
            return True

    async def _cut_over_base(self, migration: KnowledgeBaseMigration, runner: str) -> bool:
        async with self._memories.tables.lock, self._knowledge.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not MigrationState.BACKFILLING:
                return False
            key = (stored.namespace, stored.kb_ref)
            base = self._knowledge.tables.bases.get(key)
            if base is None:
                self._base_deleted(*key)
                return False
            if base.generation != stored.from_generation:
                raise RuntimeError("the knowledge base moved on without this migration")
            documents = self._base_documents(stored)
            if any(version.migrated_chunk_count is None for _, version in documents):
                return False
            target, chunking = stored.target, stored.target_chunking
            self._knowledge.tables.bases[key] = replace(
                base,
                embedder=target.name,
                model=target.model,
                dimension=target.dimension,
                normalized=target.normalized,
                chunking=chunking.kind,
                chunk_size=chunking.size,
                chunk_overlap=chunking.overlap,
                generation=base.generation + 1,
            )
            for doc_key, version in documents:
                assert version.migrated_chunk_count is not None
                document = replace(version.document, chunk_count=version.migrated_chunk_count)
                self._knowledge.tables.documents[doc_key] = replace(version, document=document)
            self._save(
                replace(stored, state=MigrationState.RETIRING, cut_over_at=self._now(), document_cursor=None)
            )
            await self._audit.append(
                kind="embedding_migration",
                actor="system:tokensvc",
                action="cut over embedding migration",
                target=f"migration:{stored.id} {stored.subject}",
                outcome="succeeded",
                reason="",
                detail=f"the knowledge base now reads {target.name} ({target.dimension}), {chunking.kind} "
                f"chunking ({chunking.size}/{chunking.overlap})",
            )
            return True

    async def _clear_base(
        self, migration: KnowledgeBaseMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        async with self._memories.tables.lock, self._knowledge.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not migration.state:
                return None
            retiring = stored.state is MigrationState.RETIRING
            gone = stored.from_generation if retiring else stored.from_generation + 1
            cleared, documents = 0, 0
            for doc_key, version in self._base_documents(stored):
                chunks = version.chunks.get(gone, ())
                if not chunks:
                    continue
                kept = {g: c for g, c in version.chunks.items() if g != gone}
                self._knowledge.tables.documents[doc_key] = replace(version, chunks=kept)
                cleared += len(chunks)
                documents += 1
                if documents == limit:
                    break
            self._leases[stored.id] = self._now() + timedelta(seconds=lease_seconds)
            return cleared, self._save(stored)

    async def pending_documents(
        self, migration: KnowledgeBaseMigration, *, limit: int
    ) -> list[PendingDocument]:
        held = self._held(migration, migration.lease_owner or "")
        if held is None or held.state is not MigrationState.BACKFILLING:
            return []
        out = []
        for (_, _, ref), version in self._base_documents(held):
            if migration.document_cursor is not None and ref <= migration.document_cursor:
                continue
            if version.migrated_chunk_count is not None:
                continue
            chunks = () if migration.rechunks else version.chunks.get(held.from_generation, ())
            stored = tuple(
                StoredChunk(
                    c.passage.chunk_index,
                    c.passage.text,
                    c.passage.start,
                    c.passage.end,
                    c.passage.heading_path,
                    c.passage.location,
                )
                for c in chunks
            )
            out.append(
                PendingDocument(
                    ref,
                    version.document.version,
                    version.document.content_sha256,
                    version.text,
                    stored,
                    version.spans,
                )
            )
            if len(out) == limit:
                break
        return out

    async def store_documents(
        self,
        migration: KnowledgeBaseMigration,
        runner: str,
        documents: Sequence[tuple[PendingDocument, Sequence[ChunkRow]]],
        *,
        lease_seconds: float,
    ) -> KnowledgeBaseMigration | None:
        async with self._memories.tables.lock, self._knowledge.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not MigrationState.BACKFILLING:
                return None
            written = 0
            for pending, chunks in documents:
                key = (stored.namespace, stored.kb_ref, pending.ref)
                version = self._knowledge.tables.documents.get(key)
                if (
                    version is None
                    or version.document.version != pending.version
                    or version.document.content_sha256 != pending.content_sha256
                    or version.migrated_chunk_count is not None
                ):
                    continue
                generations = dict(version.chunks)
                generations[stored.from_generation + 1] = tuple(
                    stored_chunk(version.document, c) for c in chunks
                )
                self._knowledge.tables.documents[key] = replace(
                    version, chunks=generations, migrated_chunk_count=len(chunks)
                )
                written += 1
            self._leases[stored.id] = self._now() + timedelta(seconds=lease_seconds)
            done = stored.rows_done + written
            return self._save(
                replace(
                    stored,
                    rows_done=done,
                    rows_total=max(stored.rows_total, done),
                    failures=0,
                    reason="",
                    document_cursor=documents[-1][0].ref if documents else stored.document_cursor,
                )
            )

    async def base_size(self, namespace: str, kb_ref: str) -> tuple[int, int, int, int]:
        base = self._knowledge.tables.bases.get((namespace, kb_ref))
        generation = 0 if base is None else base.generation
        versions = [
            v for key, v in self._knowledge.tables.documents.items() if key[:2] == (namespace, kb_ref)
        ]
        lengths = [len(c.passage.text) for v in versions for c in v.chunks.get(generation, ())]
        average = round(sum(lengths) / len(lengths)) if lengths else 0
        return len(versions), len(lengths), average, sum(1 for v in versions if v.text is None)

    async def clear_slot(
        self, migration: EmbeddingMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        match migration:
            case MemorySpaceMigration():
                return await self._clear_space(migration, runner, limit=limit, lease_seconds=lease_seconds)
            case KnowledgeBaseMigration():
                return await self._clear_base(migration, runner, limit=limit, lease_seconds=lease_seconds)

    async def _clear_space(
        self, migration: MemorySpaceMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        async with self._memories.tables.lock:
            stored = self._held(migration, runner)
            if stored is None or stored.state is not migration.state:
                return None
            retiring = stored.state is MigrationState.RETIRING
            slot = stored.from_generation % 2 if retiring else stored.target_slot
            batch = [row for row in self._ordered(migration) if row.slots[slot] is not None][:limit]
            for row in batch:
                self._memories.tables.rows[row.bucket][row.id] = replace(
                    row, slots=with_vector(row.slots, slot, None)
                )
            cursor = (batch[-1].bucket, batch[-1].id) if batch else stored.cursor
            self._leases[stored.id] = self._now() + timedelta(seconds=lease_seconds)
            return len(batch), self._save(replace(stored, cursor=cursor))

    async def record_failure(
        self, migration: EmbeddingMigration, runner: str, reason: str, *, pause_after: int
    ) -> EmbeddingMigration | None:
        async with self._memories.tables.lock:
            stored = self._held(migration, runner)
            if stored is None:
                return None
            failures = stored.failures + 1
            if failures < pause_after:
                return self._save(replace(stored, failures=failures, reason=reason))
            self._leases.pop(stored.id, None)
            return self._save(
                replace(
                    stored, failures=failures, reason=reason, state=MigrationState.PAUSED, lease_owner=None
                )
            )
