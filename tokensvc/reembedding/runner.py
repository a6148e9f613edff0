"""The background worker every replica runs for re-embedding: one kind of leased job
(`tokensvc.jobs`) whose work drives a migration through its backfill, cutover and clean-up.

The job runner claims, holds leases, backs off and pauses; this module says what a migration's
turn is: by its state, its kind's backfill (`MemoryBackfill`, `KnowledgeBackfill`, through
`BatchPipeline`), or the clean-up of the vectors it leaves behind, then its end.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass

from tokensvc.audit import SYSTEM_ACTOR, AuditLog, AuditOutcome
from tokensvc.embedders import EmbedderRegistry, ScheduledEmbedder
from tokensvc.errors import Reason
from tokensvc.jobs import JobRunner, JobSettings, JobTurn
from tokensvc.reembedding.backfill import Backfill, batch_size_of
from tokensvc.reembedding.events import announce
from tokensvc.reembedding.knowledge_backfill import KnowledgeBackfill
from tokensvc.reembedding.memory_backfill import MemoryBackfill
from tokensvc.reembedding.pipeline import BatchPipeline
from tokensvc.storage.ports import MigrationRunnerStore
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
)

__all__ = ["MigrationRunner", "RunnerSettings"]


@dataclass(frozen=True)
class RunnerSettings(JobSettings):
    """The job runner's settings (lease, backoff, pause after embedder failures, parallel
    migrations) and re-embedding's own."""

    # How long the old vectors stay after the cutover: longer than any replica caches a pin.
    retire_seconds: float = 30.0
    batch_size: int = 0  # 0: the target embedder's own


class MigrationRunner:
    """Runs migrations in the background: claims up to `parallel`, drives each as far as it can,
    claims again (`tokensvc.jobs.JobRunner` with re-embedding's work)."""

    def __init__(
        self,
        store: MigrationRunnerStore,
        embedders: EmbedderRegistry,
        audit: AuditLog,
        settings: RunnerSettings | None = None,
        *,
        runner_id: str | None = None,
    ):
        settings = settings or RunnerSettings()
        self.runner_id = runner_id or f"runner-{uuid.uuid4()}"
        self._jobs = JobRunner(
            _Reembedding(store, embedders, audit, settings, self.runner_id),
            _MigrationJobs(store, embedders, settings),
            settings,
            runner_id=self.runner_id,
        )

    def wake(self) -> None:
        """Look for work now instead of at the next poll (a migration was started here)."""
        self._jobs.wake()

    async def run(self) -> None:
        """Forever: drive up to `parallel` migrations at once; when none is left to claim, wait
        `poll_seconds` (or a wake-up, or the end of a drive). Errors are logged."""
        await self._jobs.run()

    async def step(self) -> bool:
        """Claim one migration and drive it until it finishes, waits or is lost; False: none."""
        return await self._jobs.step()


class _MigrationJobs:
    """The migration store as a leased-job store: a claim takes only what this runner can do (a
    backfill whose target embedder it has, a clean-up `retire_seconds` after the cutover)."""

    def __init__(self, store: MigrationRunnerStore, embedders: EmbedderRegistry, settings: RunnerSettings):
        self._store = store
        self._embedders = embedders
        self._retire_seconds = settings.retire_seconds

    async def claim(
        self, runner: str, *, lease_seconds: float, busy: Collection[str]
    ) -> EmbeddingMigration | None:
        return await self._store.claim(
            runner,
            lease_seconds=lease_seconds,
            embedders=self._embedders.names,
            retire_after_seconds=self._retire_seconds,
            busy=busy,
        )

    async def renew(self, job: EmbeddingMigration, runner: str, *, lease_seconds: float) -> bool:
        return await self._store.renew(job, runner, lease_seconds=lease_seconds)

    async def record_failure(
        self, job: EmbeddingMigration, runner: str, reason: str, *, pause_after: int
    ) -> EmbeddingMigration | None:
        return await self._store.record_failure(job, runner, reason, pause_after=pause_after)


class _Reembedding:
    """Re-embedding as a kind of job: a migration's turn by its state, and its pause."""

    name = "embedding migration"

    def __init__(
        self,
        store: MigrationRunnerStore,
        embedders: EmbedderRegistry,
        audit: AuditLog,
        settings: RunnerSettings,
        runner_id: str,
    ):
        self._store = store
        self._embedders = embedders
        self._audit = audit
        self._settings = settings
        lease = settings.lease_seconds
        self._memory_backfill = MemoryBackfill(store, runner_id=runner_id, lease_seconds=lease)
        self._knowledge_backfill = KnowledgeBackfill(store, runner_id=runner_id, lease_seconds=lease)

    async def work(self, job: EmbeddingMigration, turn: JobTurn[EmbeddingMigration]) -> None:
        if job.state is MigrationState.BACKFILLING:
            await self._backfill(job, turn)
        elif job.state is MigrationState.RETIRING:
            # Claimed only once `retire_seconds` have passed since the cutover: empty the old slot.
            await self._clear(job, turn.runner_id, MigrationState.SUCCEEDED, "succeeded")
        elif job.state is MigrationState.CANCELLING:
            await self._clear(job, turn.runner_id, MigrationState.CANCELLED, "cancelled")

    def _backfill_of(
        self, migration: EmbeddingMigration
    ) -> Backfill[MemorySpaceMigration] | Backfill[KnowledgeBaseMigration]:
        """The backfill of the migration's kind: a memory space's or a knowledge base's."""
        match migration:
            case MemorySpaceMigration():
                return self._memory_backfill
            case KnowledgeBaseMigration():
                return self._knowledge_backfill

    async def _backfill(self, migration: EmbeddingMigration, turn: JobTurn[EmbeddingMigration]) -> None:
        """Its kind's backfill with the target embedder, in batches of the embedder's size (or
        the configured one)."""
        embedder = await self._target_embedder(migration)
        if embedder is None:
            return
        size = self._settings.batch_size or batch_size_of(embedder)
        pipeline = BatchPipeline(self._store, turn, self._pause)
        match migration:
            case MemorySpaceMigration():
                await self._memory_backfill.backfill(migration, embedder, size, pipeline)
            case KnowledgeBaseMigration():
                await self._knowledge_backfill.backfill(migration, embedder, size, pipeline)

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

    async def _clear(
        self, migration: EmbeddingMigration, runner: str, end: MigrationState, event: str
    ) -> None:
        """Empty the vectors the migration leaves behind, batch by batch, then finish it."""
        state = migration.state
        backfill = self._backfill_of(migration)
        while True:
            cleared = await self._store.clear_slot(
                migration, runner, limit=backfill.clear_limit, lease_seconds=self._settings.lease_seconds
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
        await announce(
            self._audit,
            finished,
            event,
            actor=SYSTEM_ACTOR,
            action=f"finish embedding migration ({end.value})",
            outcome=AuditOutcome.SUCCEEDED,
            detail=f"{finished.rows_done} {backfill.rows} re-embedded",
        )

    async def _pause(self, migration: EmbeddingMigration, reason: str) -> None:
        paused = await self._store.transition(
            migration.id, expect=(MigrationState.BACKFILLING,), state=MigrationState.PAUSED, reason=reason
        )
        if paused is not None:
            await self.paused(paused, reason)

    async def paused(self, job: EmbeddingMigration, reason: str) -> None:
        await announce(
            self._audit,
            job,
            "paused",
            actor=SYSTEM_ACTOR,
            action="pause embedding migration",
            outcome=AuditOutcome.FAILED,
            reason=Reason.EMBEDDER_UNAVAILABLE,
            detail=reason,
        )
