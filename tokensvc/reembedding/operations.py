"""The operator's calls (MigrationService): start a migration of a memory space or a knowledge
base (or estimate one: the dry run), read one or a page of them with their progress, cancel,
resume. Each is one domain call of an RPC; the work itself is the runner's."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from tokensvc.audit import AuditLog, AuditOutcome
from tokensvc.embedders import (
    BUILTIN_EMBEDDER,
    Demand,
    EmbedderRegistry,
    EmbedderSpec,
    ScheduledEmbedder,
    WorkClass,
)
from tokensvc.errors import InvalidArgument, NotFound, Reason, TokensvcError
from tokensvc.jobs import Throughput
from tokensvc.reembedding.backfill import batch_size_of
from tokensvc.reembedding.events import announce
from tokensvc.storage.ports import KnowledgeStore, MemoryStore, MigrationOperationsStore
from tokensvc.storage.records import ALL_KNOWLEDGE_BASES, ChunkingSpec, Tenant
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
)

__all__ = [
    "EmbeddingMigrations",
    "MigrationConflict",
    "MigrationEstimate",
    "MigrationProgress",
]

# The estimate's sample: a batch, but no more text than this. The start waits for it, and the
# embedded model embeds about 1,000 characters a second per thread on two shared cores (measured):
# a batch of 16 knowledge-base passages took 12-15 s there, 35 s on a loaded machine.
_SAMPLE_CHARS = 2_000
# The dry run's sample text: words of a typical length (5 letters and a space), not the space's.
_WORDS = (
    "memory",
    "agent",
    "deploy",
    "window",
    "prefers",
    "answers",
    "weekly",
    "review",
    "staging",
    "budget",
)


class MigrationConflict(TokensvcError):
    """The migration's state does not allow this (another one runs, or it has already cut over)."""

    reason = Reason.MIGRATION_CONFLICT


@dataclass(frozen=True)
class MigrationEstimate:
    """A dry run: what a migration of the space would do and how long it would take."""

    rows: int
    source: EmbedderSpec
    target: EmbedderSpec
    items_per_second: float  # the target embedder, measured on a batch of the space's memories
    seconds: float


@dataclass(frozen=True)
class MigrationProgress:
    migration: EmbeddingMigration
    rows_per_second: float
    eta_seconds: float | None  # None: not backfilling, or no rate yet


def progress_of(migration: EmbeddingMigration) -> MigrationProgress:
    """Rate over the migration's life so far (created to last progress), ETA from it."""
    throughput = Throughput.of(
        done=migration.rows_done,
        total=migration.rows_total,
        started=migration.created_at,
        last=migration.updated_at,
        running=migration.state is MigrationState.BACKFILLING,
    )
    return MigrationProgress(migration, throughput.per_second, throughput.eta_seconds)


class EmbeddingMigrations:
    """The operator's calls (MigrationService): each one domain call of an RPC."""

    def __init__(
        self,
        store: MigrationOperationsStore,
        memories: MemoryStore,
        embedders: EmbedderRegistry,
        audit: AuditLog,
        *,
        knowledge: KnowledgeStore | None = None,
        wake: Callable[[], None] = lambda: None,
    ):
        self._store = store
        self._memories = memories
        self._knowledge = knowledge
        self._embedders = embedders
        self._audit = audit
        self._wake = wake  # this replica's runner: start on it now, not at its next poll

    async def start(
        self, namespace: str, agent: str, embedder_name: str, *, dry_run: bool, actor: str
    ) -> tuple[EmbeddingMigration | None, MigrationEstimate]:
        space = await self._memories.get_space(Tenant(namespace, agent))
        if space is None:
            raise NotFound(f"no memory space {namespace}/{agent}: nothing has been remembered there")
        embedder = self._configured(embedder_name)
        planned = MemorySpaceMigration(
            id=str(uuid.uuid4()),
            namespace=namespace,
            agent=agent,
            from_generation=space.generation,
            source=space.embedder,
            target=embedder.spec,
            state=MigrationState.BACKFILLING,
            created_by=actor,
        )
        described = f"memory space {namespace}/{agent}"
        if not dry_run:
            # First: a space whose migration has cut over (it is pinned to the target already)
            # but not finished is a conflict, not a request to migrate to its own pin.
            await self._refuse_unfinished(planned, described)
        if embedder.spec == space.embedder:
            raise InvalidArgument("embedder", f"the memory space is already pinned to {embedder_name!r}")
        _refuse_test_embedder(embedder.spec, space.embedder)
        rows, average_chars = await self._store.space_size(namespace, agent)
        estimate = await _estimate(planned, embedder, rows, rows, average_chars)
        if dry_run:
            return None, estimate
        return await self._create(replace(planned, rows_total=rows), estimate, described, "memories")

    async def start_knowledge_base(
        self,
        namespace: str,
        kb_ref: str,
        embedder_name: str,
        chunking: ChunkingSpec | None,
        *,
        dry_run: bool,
        actor: str,
    ) -> tuple[EmbeddingMigration | None, MigrationEstimate]:
        """As `start`, for a knowledge base; `chunking` None keeps the base's chunking strategy."""
        assert self._knowledge is not None, "knowledge-base migrations need the knowledge store"
        bases = await self._knowledge.get_bases(
            Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,)), [kb_ref]
        )
        if not bases:
            raise NotFound(f"no knowledge base {kb_ref!r} in namespace {namespace!r}")
        base = bases[0]
        embedder = self._configured(embedder_name)
        source = EmbedderSpec(base.embedder, base.model, base.dimension, base.normalized)
        before = ChunkingSpec(base.chunking, base.chunk_size, base.chunk_overlap)
        after = chunking or before
        if embedder.spec == source and after == before:
            raise InvalidArgument(
                "embedder", f"the knowledge base is already pinned to {embedder_name!r} with this chunking"
            )
        _refuse_test_embedder(embedder.spec, source)
        documents, chunks, average_chars, without_text = await self._store.base_size(namespace, kb_ref)
        if after != before and without_text:
            raise MigrationConflict(
                f"{without_text} documents of knowledge base {kb_ref!r} were uploaded before tokensvc "
                "kept document texts, so they cannot be re-chunked: upload them again, or migrate "
                "without a new chunking"
            )
        planned = KnowledgeBaseMigration(
            id=str(uuid.uuid4()),
            namespace=namespace,
            kb_ref=kb_ref,
            from_generation=base.generation,
            source=source,
            target=embedder.spec,
            source_chunking=before,
            target_chunking=after,
            state=MigrationState.BACKFILLING,
            created_by=actor,
        )
        described = f"knowledge base {namespace}/{kb_ref}"
        if not dry_run:
            await self._refuse_unfinished(planned, described)
        # Re-chunked, a base has about as many chunks as its text holds chunks of the new size.
        expected_chunks = round(chunks * before.size / after.size) if after != before else chunks
        estimate = await _estimate(planned, embedder, documents, expected_chunks, average_chars)
        if dry_run:
            return None, estimate
        return await self._create(planned, estimate, described, "documents")

    def _configured(self, embedder_name: str) -> ScheduledEmbedder:
        if embedder_name not in self._embedders.names:
            raise InvalidArgument(
                "embedder",
                f"{embedder_name!r} is not configured (configured: {', '.join(self._embedders.names)})",
            )
        return self._embedders.get(embedder_name)

    async def _refuse_unfinished(self, planned: EmbeddingMigration, described: str) -> None:
        """Before the estimate: a start that would conflict answers at once instead of first
        embedding a batch beside the running migration's own. `create` still decides a race."""
        if any(m.subject == planned.subject for m in await self._store.active()):
            raise _conflict(described)

    async def _create(
        self, planned: EmbeddingMigration, estimate: MigrationEstimate, described: str, rows: str
    ) -> tuple[EmbeddingMigration, MigrationEstimate]:
        created = await self._store.create(planned)
        if created is None:
            raise _conflict(described)
        self._wake()
        chunking = ""
        if isinstance(created, KnowledgeBaseMigration) and created.rechunks:
            target = created.target_chunking
            chunking = f", re-chunked {target.kind} ({target.size}/{target.overlap})"
        await announce(
            self._audit,
            created,
            "started",
            actor=planned.created_by,
            action="start embedding migration",
            outcome=AuditOutcome.STARTED,
            detail=f"{created.source.name} ({created.source.dimension}) -> {created.target.name} "
            f"({created.target.dimension}){chunking}, {created.rows_total} {rows}",
        )
        return created, estimate

    async def get(self, migration_id: str) -> MigrationProgress:
        migration = await self._store.get(migration_id)
        if migration is None:
            raise NotFound("no such migration")
        return progress_of(migration)

    async def page(self, *, limit: int, before: tuple[datetime, str] | None) -> list[MigrationProgress]:
        return [progress_of(m) for m in await self._store.page(limit=limit, before=before)]

    async def cancel(self, migration_id: str, actor: str) -> MigrationProgress:
        changed = await self._store.transition(
            migration_id,
            expect=(MigrationState.BACKFILLING, MigrationState.PAUSED),
            state=MigrationState.CANCELLING,
            reason=f"cancelled by {actor}",
        )
        if changed is None:
            current = await self.get(migration_id)
            raise MigrationConflict(
                f"the migration is {current.migration.state.value}: only a backfilling or paused "
                "migration can be cancelled (after the cutover, migrate back instead)"
            )
        self._wake()
        await announce(
            self._audit,
            changed,
            "cancel_requested",
            actor=actor,
            action="cancel embedding migration",
            outcome=AuditOutcome.STARTED,
        )
        return progress_of(changed)

    async def resume(self, migration_id: str, actor: str) -> MigrationProgress:
        changed = await self._store.transition(
            migration_id, expect=(MigrationState.PAUSED,), state=MigrationState.BACKFILLING
        )
        if changed is None:
            current = await self.get(migration_id)
            raise MigrationConflict(f"the migration is {current.migration.state.value}, not paused")
        self._wake()
        await announce(
            self._audit,
            changed,
            "resumed",
            actor=actor,
            action="resume embedding migration",
            outcome=AuditOutcome.STARTED,
        )
        return progress_of(changed)


def _refuse_test_embedder(target: EmbedderSpec, source: EmbedderSpec) -> None:
    """The built-in `hash` embedder (no meaning, always configured) is for tests: nothing pinned
    to another embedder migrates to it (migration 0021 refuses it too)."""
    if target.name == BUILTIN_EMBEDDER and source.name != BUILTIN_EMBEDDER:
        raise InvalidArgument(
            "embedder",
            f"{BUILTIN_EMBEDDER!r} is for tests: a subject pinned to {source.name!r} does not migrate to it",
        )


def _conflict(described: str) -> MigrationConflict:
    return MigrationConflict(
        f"{described} already has a migration that has not finished (tokensvc admin migrate list)"
    )


async def _estimate(
    planned: EmbeddingMigration, embedder: ScheduledEmbedder, rows: int, texts: int, average_chars: int
) -> MigrationEstimate:
    """`rows` to migrate, `texts` to embed: throughput from one batch of texts as long as the
    subject's on average, embedded by the target (its own content is read by its migration only)."""
    rate = 0.0
    if texts:
        words = max(1, average_chars // 6)
        count = max(1, min(batch_size_of(embedder), _SAMPLE_CHARS // max(1, average_chars)))
        sample = [" ".join(_WORDS[(i + w) % len(_WORDS)] for w in range(words)) for i in range(count)]
        began = time.perf_counter()
        # An admin waits for the start: interactive, in the namespace's share (the throughput it
        # measures is the model's as this replica shares it now).
        await embedder.embed_documents(sample, Demand.of(WorkClass.INTERACTIVE, planned.namespace))
        rate = len(sample) / max(time.perf_counter() - began, 1e-6)
    seconds = texts / rate if rate else 0.0
    return MigrationEstimate(rows, planned.source, planned.target, rate, seconds)
