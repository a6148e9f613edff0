"""A backfill's batch loop for one claimed migration, lent to its kind's backfill:
read a batch after the cursor, embed it, write it; at the end of a pass, pass again or cut over;
an embedder failure backs off (the job runner's policy) and retries the batch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from opentelemetry import trace

from tokensvc.errors import TokensvcError
from tokensvc.jobs import JobTurn
from tokensvc.observability.metrics import METRICS
from tokensvc.storage.ports import MigrationRunnerStore
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
)

__all__ = ["BatchPipeline"]

_tracer = trace.get_tracer("tokensvc.reembedding")
_Item = TypeVar("_Item")
_Vectors = TypeVar("_Vectors")
_Migration = TypeVar("_Migration", MemorySpaceMigration, KnowledgeBaseMigration)


class BatchPipeline:
    """The batch loop lent to one migration's backfill for the runner's turn on it (`turn`: its
    lease and the failure policy); `pause` pauses the migration with a reason."""

    def __init__(
        self,
        store: MigrationRunnerStore,
        turn: JobTurn[EmbeddingMigration],
        pause: Callable[[EmbeddingMigration, str], Awaitable[None]],
    ):
        self._store = store
        self._turn = turn
        self._pause = pause

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
        """The next batch is read and embedded while this one is written, so the embedder (the
        slow part) does not wait for the database. `read` answering None pauses the migration
        with `unreadable`. A lost lease stops the loop, cancelling the batch being embedded."""
        lease = self._turn.lease
        batch = await read(migration)
        embedding: asyncio.Task[_Vectors] | None = None
        try:
            while not lease.lost:
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
                if not await lease.while_held(embedding):
                    return  # taken over or cancelled: nobody may write what it embeds
                try:
                    vectors = embedding.result()
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
        """Nothing left after the cursor: pass again from the start (rows written behind the
        cursor), or cut over. None: stop here (cut over, or the lease is lost)."""
        # A long pass may have outlived the lease with nobody taking it: extend it before acting.
        if not await self._turn.lease.renew():
            return None
        runner = self._turn.runner_id
        if not migration.at_start:
            return migration.rewound() if await self._store.rewind(migration, runner) else None
        if await self._cut_over(migration):
            return None  # the old slot is emptied once `retire_seconds` have passed
        current = await self._store.get(migration.id)
        if current is None or current.lease_owner != runner:
            return None
        await asyncio.sleep(0.05)  # a row arrived between the pass and the check
        return migration

    async def _cut_over(self, migration: EmbeddingMigration) -> bool:
        with _tracer.start_as_current_span("reembedding.cut_over") as span:
            span.set_attribute("tokensvc.migration", migration.id)
            done = await self._store.cut_over(migration, self._turn.runner_id)
            span.set_attribute("tokensvc.migration.cut_over", done)
        if done:  # audited by the store, in the cutover's own transaction
            METRICS.migration_events.labels("cut_over").inc()
        return done

    async def _embedder_failed(self, migration: EmbeddingMigration, exc: Exception) -> bool:
        """Count the failure; True (after the backoff) to retry the batch, False when the
        migration paused or the lease is lost."""
        what = exc.message if isinstance(exc, TokensvcError) else type(exc).__name__
        METRICS.migration_events.labels("embedder_failure").inc()
        return await self._turn.failed(migration, f"the target embedder failed: {what}")
