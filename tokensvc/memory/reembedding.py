"""Re-embedding migrations: a memory space or a knowledge base moves to another embedder (a
knowledge base optionally to another chunking strategy too) while it serves (issue 16).

`EmbeddingMigrations` is what operators call (start, dry run, status, list, cancel, resume);
`MigrationRunner` is the background worker every replica runs. The state lives in PostgreSQL
(`EmbeddingMigrationStore`); one runner at a time holds a migration's lease, renewed with every
batch, and another replica takes it over when the lease expires. The state machine:

    BACKFILLING --(every live memory has a target vector: the cutover)--> RETIRING --> SUCCEEDED
    BACKFILLING <--(persistent embedder failure / resume)--> PAUSED
    BACKFILLING | PAUSED --(cancel)--> CANCELLING --> CANCELLED

BACKFILLING embeds the space's memories with the target embedder into the vector slot the space
does not read, in batches of the embedder's size, each batch committed with the cursor and the
progress (a runner killed mid-batch redoes that batch only). Memories written meanwhile are caught
by a second pass from the start; the cutover itself checks, with every write of the space held
off, that nothing is missing, pins the target and bumps the space's generation in one
transaction. Until then searches read the current slot only; from then on, the target slot only.
RETIRING is claimed `retire_seconds` after the cutover (longer than any replica caches a pin, so
a search that embedded its query with the old model still finds the old vectors), then empties
the old slot. CANCELLING empties the target slot: nothing a search reads ever changed.

A knowledge base's migration is the same machine over documents instead of memories: its
backfill writes every current document's chunks of the base's next generation (re-chunked from
the document's stored text when the chunking changes), uploads meanwhile write both generations,
and the cutover pins the target and bumps the base's generation; searches read one generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

import numpy as np
from opentelemetry import trace

from tokensvc.audit import SYSTEM_ACTOR, AuditKind, AuditLog, AuditOutcome
from tokensvc.embedders import (
    BUILTIN_EMBEDDER,
    Demand,
    EmbedderRegistry,
    EmbedderSpec,
    ScheduledEmbedder,
    WorkClass,
)
from tokensvc.errors import (
    EmbedderUnavailable,
    InvalidArgument,
    NotFound,
    Reason,
    TokensvcError,
)
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.observability.metrics import METRICS, observe_embedding
from tokensvc.retrieval import unit_vector
from tokensvc.storage.ports import EmbeddingMigrationStore, KnowledgeStore, MemoryStore
from tokensvc.storage.records import (
    ALL_KNOWLEDGE_BASES,
    ChunkingSpec,
    ChunkRow,
    EmbeddingMigration,
    MigrationState,
    PendingDocument,
    PendingMemory,
    StoredChunk,
    Tenant,
)

__all__ = [
    "ChunkingSpec",
    "EmbeddingMigration",
    "EmbeddingMigrations",
    "MigrationConflict",
    "MigrationEstimate",
    "MigrationProgress",
    "MigrationRunner",
    "MigrationState",
    "RunnerSettings",
]

_log = logging.getLogger(__name__)
_tracer = trace.get_tracer("tokensvc.memory.reembedding")
_DEFAULT_BATCH = 64
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
_CLEAR_BATCH = 1000  # memories per clean-up transaction
_CLEAR_DOCUMENTS = 100  # a knowledge base's: documents (each with all its chunks)
# Documents read per knowledge-base batch (one transaction); their chunks are embedded in the
# embedder's batches.
_DOCUMENT_BATCH = 32
# Memories a space's backfill reads at once (handed to the embedder a batch at a time): on Citus
# each read is a multi-shard statement of seconds, paid per few hundred memories so.
_MEMORY_READ = 256
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
_Vectors = TypeVar("_Vectors")


class MigrationConflict(TokensvcError):
    """The migration's state does not allow this (another one runs, or it has already cut over)."""

    reason = Reason.MIGRATION_CONFLICT


def batch_size_of(embedder: ScheduledEmbedder) -> int:
    """The embedder's own batch size when it has one (the local model, OpenAI-compatible servers)."""
    size = getattr(embedder, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else _DEFAULT_BATCH


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
    rate = 0.0
    if migration.created_at is not None and migration.updated_at is not None and migration.rows_done:
        elapsed = (migration.updated_at - migration.created_at).total_seconds()
        rate = migration.rows_done / elapsed if elapsed > 0 else 0.0
    eta = None
    if migration.state is MigrationState.BACKFILLING and rate > 0:
        eta = max(0.0, migration.rows_total - migration.rows_done) / rate
    return MigrationProgress(migration, rate, eta)


class EmbeddingMigrations:
    """The operator's calls (MigrationService): each one domain call of an RPC."""

    def __init__(
        self,
        store: EmbeddingMigrationStore,
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
        planned = EmbeddingMigration(
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
        planned = EmbeddingMigration(
            id=str(uuid.uuid4()),
            namespace=namespace,
            agent=None,
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
        METRICS.migration_events.labels("started").inc()
        chunking = ""
        if created.rechunks and created.target_chunking is not None:
            target = created.target_chunking
            chunking = f", re-chunked {target.kind} ({target.size}/{target.overlap})"
        await self._audit.record(
            AuditKind.EMBEDDING_MIGRATION,
            actor=planned.created_by,
            action="start embedding migration",
            target=_target(created),
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
        METRICS.migration_events.labels("cancel_requested").inc()
        await self._audit.record(
            AuditKind.EMBEDDING_MIGRATION,
            actor=actor,
            action="cancel embedding migration",
            target=_target(changed),
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
        METRICS.migration_events.labels("resumed").inc()
        await self._audit.record(
            AuditKind.EMBEDDING_MIGRATION,
            actor=actor,
            action="resume embedding migration",
            target=_target(changed),
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


def _bulk(migration: EmbeddingMigration) -> Demand:
    """A migration's batches: bulk work, in its namespace's fair share."""
    return Demand.of(WorkClass.BULK, migration.namespace)


def _target(migration: EmbeddingMigration) -> str:
    return f"migration:{migration.id} {migration.subject}"


@dataclass(frozen=True)
class RunnerSettings:
    lease_seconds: float = 30.0
    # How long the old vectors stay after the cutover: longer than any replica caches a pin.
    retire_seconds: float = 30.0
    # Consecutive embedder failures before the migration pauses, and the first retry's wait.
    pause_after: int = 5
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 60.0
    poll_seconds: float = 2.0
    batch_size: int = 0  # 0: the target embedder's own
    # Migrations one runner drives at once, each in a task of its own, so a slow one (a large
    # space on Citus, an embedder that keeps failing) does not hold the others back.
    parallel: int = 2


class MigrationRunner:
    """Runs migrations in the background: claims up to `parallel`, drives each as far as it can,
    claims again."""

    def __init__(
        self,
        store: EmbeddingMigrationStore,
        embedders: EmbedderRegistry,
        audit: AuditLog,
        settings: RunnerSettings | None = None,
        *,
        runner_id: str | None = None,
    ):
        self._store = store
        self._embedders = embedders
        self._audit = audit
        self._settings = settings or RunnerSettings()
        self.runner_id = runner_id or f"runner-{uuid.uuid4()}"
        self._woken = asyncio.Event()
        self._driving: set[str] = set()  # ids of the migrations this runner drives now

    def wake(self) -> None:
        """Look for work now instead of at the next poll (a migration was started here)."""
        self._woken.set()

    async def run(self) -> None:
        """Forever: drive up to `parallel` migrations at once; when none is left to claim, wait
        `poll_seconds` (or a wake-up, or the end of a drive). Errors are logged."""
        driving: set[asyncio.Task[None]] = set()
        try:
            while True:
                claimed = None
                if len(driving) < self._settings.parallel:
                    claimed = await self._logged(self._claim())
                if claimed is not None:
                    driving.add(asyncio.create_task(self._turn(claimed)))
                    continue  # perhaps another one
                woken = asyncio.create_task(self._woken.wait())
                try:
                    await asyncio.wait(
                        {woken, *driving},
                        timeout=self._settings.poll_seconds,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    woken.cancel()
                self._woken.clear()
                driving = {task for task in driving if not task.done()}
        finally:
            for task in driving:
                task.cancel()
            await asyncio.gather(*driving, return_exceptions=True)

    async def _turn(self, migration: EmbeddingMigration) -> None:
        """Drive a claimed migration; after a failure, hold its slot for `poll_seconds`, so a
        database or an embedder that is away is not asked again at once, in a loop."""
        if await self._logged(self._drive(migration)) is None:
            await asyncio.sleep(self._settings.poll_seconds)

    async def _logged(self, work: Awaitable[_Result]) -> _Result | None:
        """The result of `work`, or None when it failed (logged: the next turn tries again)."""
        try:
            return await work
        except asyncio.CancelledError:
            raise
        except TokensvcError as exc:  # the database or the embedder is away: try again later
            _log.warning("embedding migration runner paused a turn (%s); retrying", exc.reason)
        except Exception:
            _log.exception("embedding migration runner failed; retrying")
        return None

    async def step(self) -> bool:
        """Claim one migration and drive it until it finishes, waits or is lost; False: none."""
        migration = await self._claim()
        if migration is None:
            return False
        await self._drive(migration)
        return True

    async def _claim(self) -> EmbeddingMigration | None:
        """The next migration to drive, not one this runner drives already; marked as driven."""
        migration = await self._store.claim(
            self.runner_id,
            lease_seconds=self._settings.lease_seconds,
            embedders=self._embedders.names,
            retire_after_seconds=self._settings.retire_seconds,
            busy=frozenset(self._driving),
        )
        if migration is not None:
            self._driving.add(migration.id)
        return migration

    async def _drive(self, migration: EmbeddingMigration) -> bool:
        """Drive a claimed migration until it finishes, waits or is lost; True when it did not
        fail."""
        keeper = asyncio.create_task(self._keep_lease(migration))
        try:
            if migration.state is MigrationState.BACKFILLING and migration.kb_ref is not None:
                await self._backfill_base(migration)
            elif migration.state is MigrationState.BACKFILLING:
                await self._backfill(migration)
            elif migration.state is MigrationState.RETIRING:
                await self._retire(migration)
            elif migration.state is MigrationState.CANCELLING:
                await self._clear(migration, MigrationState.CANCELLED, "cancelled")
        finally:
            keeper.cancel()
            self._driving.discard(migration.id)
        return True

    async def _keep_lease(self, migration: EmbeddingMigration) -> None:
        """Renew the lease every third of it while this runner works on the migration. A batch
        is leased from its read to its write: one that outlasts the lease (a slow embedder, a busy
        machine) would otherwise find it lapsed at every write and never make progress. Ends when
        the lease is lost (taken over, cancelled): the work finds out at its next write."""
        lease = self._settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            try:
                if not await self._store.renew(migration, self.runner_id, lease_seconds=lease):
                    return
            except TokensvcError as exc:  # the database is away: the next write will tell
                _log.warning("migration %s: the lease was not renewed (%s)", migration.id, exc.reason)
            except Exception:
                _log.exception("migration %s: the lease was not renewed", migration.id)

    async def _target_embedder(self, migration: EmbeddingMigration) -> ScheduledEmbedder | None:
        """The configured target embedder; None (the migration paused) when it differs."""
        embedder = self._embedders.get(migration.target.name)
        if embedder.spec != migration.target:
            await self._pause(
                migration,
                f"the configured embedder {migration.target.name!r} is not the migration's target "
                f"(model {migration.target.model!r}, {migration.target.dimension} dimensions)",
            )
            return None
        return embedder

    async def _backfill_base(self, migration: EmbeddingMigration) -> None:
        """A knowledge base's backfill: documents in batches, each written whole with its chunks."""
        embedder = await self._target_embedder(migration)
        if embedder is None:
            return
        size = self._settings.batch_size or batch_size_of(embedder)

        async def store(
            at: EmbeddingMigration,
            batch: list[tuple[PendingDocument, tuple[StoredChunk, ...]]],
            vectors: list[np.ndarray],
        ) -> EmbeddingMigration | None:
            stored = await self._store.store_documents(
                at,
                self.runner_id,
                _embedded_documents(batch, vectors),
                lease_seconds=self._settings.lease_seconds,
            )
            if stored is not None:
                METRICS.migration_rows.labels(at.target.name).inc(len(vectors))
            return stored

        await self._pipeline(
            migration,
            read=self._documents_after,
            ahead_of=lambda at, batch: replace(at, document_cursor=batch[-1][0].ref),
            embed=lambda batch: self._embed_spans(embedder, batch, size, _bulk(migration)),
            store=store,
            unreadable="a document has no stored text to re-chunk; upload it again",
        )

    async def _documents_after(
        self, migration: EmbeddingMigration
    ) -> list[tuple[PendingDocument, tuple[StoredChunk, ...]]] | None:
        """The next pending documents with their chunks under the target chunking; None when one
        cannot be re-chunked (no stored text: refused at the start, so only a replica that keeps
        no texts could have written it)."""
        documents = await self._store.pending_documents(migration, limit=_DOCUMENT_BATCH)
        if migration.rechunks and any(document.text is None for document in documents):
            return None
        return [(document, await _chunks_of(migration, document)) for document in documents]

    async def _embed_spans(
        self,
        embedder: ScheduledEmbedder,
        batch: list[tuple[PendingDocument, tuple[StoredChunk, ...]]],
        size: int,
        demand: Demand,
    ) -> list[np.ndarray]:
        texts = [chunk.text for _, chunks in batch for chunk in chunks]
        vectors: list[np.ndarray] = []
        for start in range(0, len(texts), size):
            vectors.extend(await self._embed_texts(embedder, texts[start : start + size], demand))
        return vectors

    async def _backfill(self, migration: EmbeddingMigration) -> None:
        """A memory space's backfill: memories in batches of the embedder's size."""
        embedder = await self._target_embedder(migration)
        if embedder is None:
            return
        size = self._settings.batch_size or batch_size_of(embedder)
        read = _ReadAhead(self._store, batch=size, rows=max(size, _MEMORY_READ)).read

        async def store(
            at: EmbeddingMigration, batch: list[PendingMemory], vectors: np.ndarray
        ) -> EmbeddingMigration | None:
            rows = list(zip(batch, vectors, strict=True))
            stored = await self._store.store_vectors(
                at, self.runner_id, rows, lease_seconds=self._settings.lease_seconds
            )
            if stored is not None:
                METRICS.migration_rows.labels(at.target.name).inc(len(rows))
            return stored

        await self._pipeline(
            migration,
            read=read,
            ahead_of=lambda at, batch: replace(at, cursor=(batch[-1].bucket, batch[-1].id)),
            embed=lambda batch: self._embed(embedder, batch, _bulk(migration)),
            store=store,
        )

    async def _pipeline(
        self,
        migration: EmbeddingMigration,
        *,
        read: Callable[[EmbeddingMigration], Awaitable[list[_Item] | None]],
        ahead_of: Callable[[EmbeddingMigration, list[_Item]], EmbeddingMigration],
        embed: Callable[[list[_Item]], Coroutine[Any, Any, _Vectors]],
        store: Callable[[EmbeddingMigration, list[_Item], _Vectors], Awaitable[EmbeddingMigration | None]],
        unreadable: str = "",
    ) -> None:
        """Both backfills: read a batch after the cursor, embed it, write it; the next batch is
        read and embedded while this one is written, so the embedder (the slow part) does not wait
        for the database. At the end of a pass, `_end_of_pass`; an embedder failure backs off and
        retries the same batch; `read` answering None pauses the migration with `unreadable`."""
        batch = await read(migration)
        embedding: asyncio.Task[_Vectors] | None = None
        try:
            while True:
                if batch is None:
                    await self._pause(migration, unreadable)
                    return
                if not batch:
                    after = await self._end_of_pass(migration)
                    if after is None:
                        return
                    migration = after
                    batch = await read(migration)
                    continue
                if embedding is None:
                    embedding = asyncio.create_task(embed(batch))
                try:
                    vectors = await embedding
                except Exception as exc:
                    embedding = None
                    failed = await self._embedder_failed(migration, exc)
                    if failed is None:
                        return
                    migration = failed
                    continue  # the same batch again
                ahead = await read(ahead_of(migration, batch))
                embedding = asyncio.create_task(embed(ahead)) if ahead else None
                stored = await store(migration, batch, vectors)
                if stored is None:
                    return  # the lease was lost, or the migration was cancelled
                migration, batch = stored, ahead
        finally:
            if embedding is not None:
                embedding.cancel()

    async def _end_of_pass(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        """Nothing left after the cursor: pass again from the start (memories written behind the
        cursor), or cut over. None: stop here (cut over, or the lease is lost)."""
        # A long pass may have outlived the lease with nobody taking it: extend it before acting.
        if not await self._store.renew(migration, self.runner_id, lease_seconds=self._settings.lease_seconds):
            return None
        if not migration.at_start:
            return (
                replace(migration, cursor=None, document_cursor=None)
                if await self._store.rewind(migration, self.runner_id)
                else None
            )
        if await self._cut_over(migration):
            return None  # the old slot is emptied once `retire_seconds` have passed
        current = await self._store.get(migration.id)
        if current is None or current.lease_owner != self.runner_id:
            return None
        await asyncio.sleep(0.05)  # a memory arrived between the pass and the check
        return migration

    async def _embed(
        self, embedder: ScheduledEmbedder, batch: list[PendingMemory], demand: Demand
    ) -> np.ndarray:
        return await self._embed_texts(embedder, [p.content for p in batch], demand)

    async def _embed_texts(self, embedder: ScheduledEmbedder, texts: list[str], demand: Demand) -> np.ndarray:
        with _tracer.start_as_current_span("reembedding.batch") as span:
            span.set_attribute("tokensvc.embed.count", len(texts))
            vectors = await observe_embedding(
                embedder.spec.name, embedder.embed_documents(texts, demand), texts=len(texts)
            )
            if vectors.ndim != 2 or vectors.shape[1] != embedder.spec.dimension:
                # Counted as the embedder's failure (it pauses the migration if it persists).
                raise EmbedderUnavailable(
                    f"the embedder returned vectors of shape {vectors.shape}, not "
                    f"{embedder.spec.dimension} dimensions"
                )
            return np.stack([unit_vector(v, "embedding") for v in vectors])

    async def _cut_over(self, migration: EmbeddingMigration) -> bool:
        with _tracer.start_as_current_span("reembedding.cut_over") as span:
            span.set_attribute("tokensvc.migration", migration.id)
            done = await self._store.cut_over(migration, self.runner_id)
            span.set_attribute("tokensvc.migration.cut_over", done)
        if done:  # audited by the store, in the cutover's own transaction
            METRICS.migration_events.labels("cut_over").inc()
        return done

    async def _retire(self, migration: EmbeddingMigration) -> None:
        """Empty the old slot; claimed only once `retire_seconds` have passed since the cutover."""
        await self._clear(migration, MigrationState.SUCCEEDED, "succeeded")

    async def _clear(self, migration: EmbeddingMigration, end: MigrationState, event: str) -> None:
        state = migration.state
        while True:
            cleared = await self._store.clear_slot(
                migration,
                self.runner_id,
                limit=_CLEAR_BATCH if migration.kb_ref is None else _CLEAR_DOCUMENTS,
                lease_seconds=self._settings.lease_seconds,
            )
            if cleared is None:
                return
            count, migration = cleared
            if count == 0:
                break
        finished = await self._store.transition(
            migration.id, expect=(state,), state=end, reason=migration.reason
        )
        if finished is None:
            return
        METRICS.migration_events.labels(event).inc()
        await self._audit.record(
            AuditKind.EMBEDDING_MIGRATION,
            actor=SYSTEM_ACTOR,
            action=f"finish embedding migration ({end.value})",
            target=_target(finished),
            outcome=AuditOutcome.SUCCEEDED,
            detail=f"{finished.rows_done} {'documents' if finished.kb_ref else 'memories'} re-embedded",
        )

    async def _embedder_failed(
        self, migration: EmbeddingMigration, exc: Exception
    ) -> EmbeddingMigration | None:
        """Count the failure; back off and return the migration to retry, None when it paused."""
        reason = f"the target embedder failed: {exc.message if isinstance(exc, TokensvcError) else type(exc).__name__}"
        METRICS.migration_events.labels("embedder_failure").inc()
        failed = await self._store.record_failure(
            migration, self.runner_id, reason, pause_after=self._settings.pause_after
        )
        if failed is None:
            return None
        if failed.state is MigrationState.PAUSED:
            await self._paused(failed, reason)
            return None
        wait = min(
            self._settings.backoff_seconds * 2 ** (failed.failures - 1), self._settings.max_backoff_seconds
        )
        _log.warning("migration %s: %s; retrying in %.1f s", migration.id, reason, wait)
        await asyncio.sleep(wait)
        return failed

    async def _pause(self, migration: EmbeddingMigration, reason: str) -> None:
        paused = await self._store.transition(
            migration.id, expect=(MigrationState.BACKFILLING,), state=MigrationState.PAUSED, reason=reason
        )
        if paused is not None:
            await self._paused(paused, reason)

    async def _paused(self, migration: EmbeddingMigration, reason: str) -> None:
        METRICS.migration_events.labels("paused").inc()
        await self._audit.record(
            AuditKind.EMBEDDING_MIGRATION,
            actor=SYSTEM_ACTOR,
            action="pause embedding migration",
            target=_target(migration),
            outcome=AuditOutcome.FAILED,
            reason=Reason.EMBEDDER_UNAVAILABLE,
            detail=reason,
        )


class _ReadAhead:
    """A space's pending memories read `rows` at a time and handed out a `batch` at a time. A
    read continues the batch handed out before only when the cursor is that batch's end; from any
    other cursor (a rewind to the start, a retried batch) it reads the store again. The rows held
    may go stale (changed or forgotten since): the store's write skips those, as it does for a
    single batch read ahead, and the next pass catches what changed."""

    def __init__(self, store: EmbeddingMigrationStore, *, batch: int, rows: int):
        self._store = store
        self._batch = batch
        self._rows = rows
        self._held: list[PendingMemory] = []
        self._held_after: tuple[str, str] | None = None  # the cursor `_held` continues

    async def read(self, at: EmbeddingMigration) -> list[PendingMemory]:
        if at.cursor is None or at.cursor != self._held_after or not self._held:
            self._held = await self._store.pending(at, limit=self._rows)
        batch, self._held = self._held[: self._batch], self._held[self._batch :]
        if batch:
            self._held_after = (batch[-1].bucket, batch[-1].id)
        return batch


async def _chunks_of(migration: EmbeddingMigration, document: PendingDocument) -> tuple[StoredChunk, ...]:
    """The document's chunks under the target chunking: cut again from its stored text when the
    migration changes the chunking (in a thread: chunking a large text takes a while), else the
    chunks it has."""
    if not migration.rechunks:
        return document.chunks
    assert migration.target_chunking is not None
    target = migration.target_chunking
    if document.text is None:
        # Refused at the start; a document from a replica that keeps no texts would be this.
        raise EmbedderUnavailable(
            f"document {document.ref!r} has no stored text to re-chunk; upload it again"
        )
    strategy = ChunkingStrategy.from_stored(target.kind, target.size, target.overlap)
    chunks = await asyncio.to_thread(chunk_document, document.text, strategy)
    return tuple(StoredChunk(c.index, c.text, c.start, c.end, tuple(c.heading_path)) for c in chunks)


def _embedded_documents(
    batch: list[tuple[PendingDocument, tuple[StoredChunk, ...]]], vectors: list[np.ndarray]
) -> list[tuple[PendingDocument, list[ChunkRow]]]:
    """Each document with its chunks and their vectors (`vectors` in the batch's chunk order)."""
    rows: list[tuple[PendingDocument, list[ChunkRow]]] = []
    at = 0
    for document, chunks in batch:
        rows.append(
            (
                document,
                [
                    ChunkRow(c.index, c.text, c.start, c.end, c.heading_path, vectors[at + i])
                    for i, c in enumerate(chunks)
                ],
            )
        )
        at += len(chunks)
    return rows
