"""The background worker every replica runs: claims migrations, holds their leases, drives each
through its backfill, cutover and clean-up, backs off and pauses when the target embedder fails.

What a batch is depends on the kind (`MemoryBackfill`, `KnowledgeBackfill`: the runner holds one
of each and picks by the migration's subject); the batch loop (`pipeline`), the end of a pass,
the cutover, the clean-up and the failures are the same for both.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import trace

from tokensvc.audit import SYSTEM_ACTOR, AuditLog, AuditOutcome
from tokensvc.embedders import EmbedderRegistry, ScheduledEmbedder
from tokensvc.errors import Reason, TokensvcError
from tokensvc.observability.metrics import METRICS
from tokensvc.reembedding.backfill import Backfill, batch_size_of
from tokensvc.reembedding.events import announce
from tokensvc.reembedding.knowledge_backfill import KnowledgeBackfill
from tokensvc.reembedding.memory_backfill import MemoryBackfill
from tokensvc.storage.ports import MigrationRunnerStore
from tokensvc.storage.records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
)

__all__ = ["MigrationRunner", "RunnerSettings"]

_log = logging.getLogger(__name__)
_tracer = trace.get_tracer("tokensvc.reembedding")
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
_Vectors = TypeVar("_Vectors")
_Migration = TypeVar("_Migration", MemorySpaceMigration, KnowledgeBaseMigration)


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
        store: MigrationRunnerStore,
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
        lease = self._settings.lease_seconds
        self._memory_backfill = MemoryBackfill(store, runner_id=self.runner_id, lease_seconds=lease)
        self._knowledge_backfill = KnowledgeBackfill(store, runner_id=self.runner_id, lease_seconds=lease)

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

    def _backfill_of(
        self, migration: EmbeddingMigration
    ) -> Backfill[MemorySpaceMigration] | Backfill[KnowledgeBaseMigration]:
        """The backfill of the migration's kind: a memory space's or a knowledge base's."""
        match migration:
            case MemorySpaceMigration():
                return self._memory_backfill
            case KnowledgeBaseMigration():
                return self._knowledge_backfill

    async def _drive(self, migration: EmbeddingMigration) -> bool:
        """Drive a claimed migration until it finishes, waits or is lost; True when it did not
        fail."""
        keeper = asyncio.create_task(self._keep_lease(migration))
        try:
            if migration.state is MigrationState.BACKFILLING:
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

    async def _backfill(self, migration: EmbeddingMigration) -> None:
        """Its kind's backfill with the target embedder, in batches of the embedder's size (or
        the configured one)."""
        embedder = await self._target_embedder(migration)
        if embedder is None:
            return
        size = self._settings.batch_size or batch_size_of(embedder)
        match migration:
            case MemorySpaceMigration():
                await self._memory_backfill.backfill(migration, embedder, size, self)
            case KnowledgeBaseMigration():
                await self._knowledge_backfill.backfill(migration, embedder, size, self)

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

    async def pipeline(
        self,
        migration: _Migration,
        *,
        read: Callable[[_Migration], Awaitable[list[_Item] | None]],
        ahead_of: Callable[[_Migration, list[_Item]], _Migration],
        embed: Callable[[list[_Item]], Coroutine[Any, Any, _Vectors]],
        store: Callable[[_Migration, list[_Item], _Vectors], Awaitable[_Migration | None]],
        unreadable: str = "",
    ) -> None:
        """Both backfills (`tokensvc.reembedding.backfill.Pipeline`): read a batch after the
        cursor, embed it, write it; the next batch is read and embedded while this one is written,
        so the embedder (the slow part) does not wait for the database. At the end of a pass,
        `_end_of_pass`; an embedder failure backs off and retries the same batch; `read` answering
        None pauses the migration with `unreadable`."""
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
                    if not await self._embedder_failed(migration, exc):
                        return
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

    async def _end_of_pass(self, migration: _Migration) -> _Migration | None:
        """Nothing left after the cursor: pass again from the start (memories written behind the
        cursor), or cut over. None: stop here (cut over, or the lease is lost)."""
        # A long pass may have outlived the lease with nobody taking it: extend it before acting.
        if not await self._store.renew(migration, self.runner_id, lease_seconds=self._settings.lease_seconds):
            return None
        if not migration.at_start:
            return migration.rewound() if await self._store.rewind(migration, self.runner_id) else None
        if await self._cut_over(migration):
            return None  # the old slot is emptied once `retire_seconds` have passed
        current = await self._store.get(migration.id)
        if current is None or current.lease_owner != self.runner_id:
            return None
        await asyncio.sleep(0.05)  # a memory arrived between the pass and the check
        return migration

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
        backfill = self._backfill_of(migration)
        while True:
            cleared = await self._store.clear_slot(
                migration,
                self.runner_id,
                limit=backfill.clear_limit,
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
        await announce(
            self._audit,
            finished,
            event,
            actor=SYSTEM_ACTOR,
            action=f"finish embedding migration ({end.value})",
            outcome=AuditOutcome.SUCCEEDED,
            detail=f"{finished.rows_done} {backfill.rows} re-embedded",
        )

    async def _embedder_failed(self, migration: EmbeddingMigration, exc: Exception) -> bool:
        """Count the failure; back off and answer True to retry, False when it paused (or the
        lease is lost)."""
        reason = f"the target embedder failed: {exc.message if isinstance(exc, TokensvcError) else type(exc).__name__}"
        METRICS.migration_events.labels("embedder_failure").inc()
        failed = await self._store.record_failure(
            migration, self.runner_id, reason, pause_after=self._settings.pause_after
        )
        if failed is None:
            return False
        if failed.state is MigrationState.PAUSED:
            await self._paused(failed, reason)
            return False
        wait = min(
            self._settings.backoff_seconds * 2 ** (failed.failures - 1), self._settings.max_backoff_seconds
        )
        _log.warning("migration %s: %s; retrying in %.1f s", migration.id, reason, wait)
        await asyncio.sleep(wait)
        return True

    async def _pause(self, migration: EmbeddingMigration, reason: str) -> None:
        paused = await self._store.transition(
            migration.id, expect=(MigrationState.BACKFILLING,), state=MigrationState.PAUSED, reason=reason
        )
        if paused is not None:
            await self._paused(paused, reason)

    async def _paused(self, migration: EmbeddingMigration, reason: str) -> None:
        await announce(
            self._audit,
            migration,
            "paused",
            actor=SYSTEM_ACTOR,
            action="pause embedding migration",
            outcome=AuditOutcome.FAILED,
            reason=Reason.EMBEDDER_UNAVAILABLE,
            detail=reason,
        )
