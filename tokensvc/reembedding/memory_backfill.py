"""A memory space's backfill: its live memories embedded by the target, in batches of the
embedder's size, into the vector slot the space does not read."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tokensvc.embedders import ScheduledEmbedder
from tokensvc.observability.metrics import METRICS
from tokensvc.reembedding.backfill import bulk_demand, embed_texts
from tokensvc.reembedding.pipeline import BatchPipeline
from tokensvc.storage.ports import MemoryBackfillStore
from tokensvc.storage.reembedding_records import MemorySpaceMigration, PendingMemory

__all__ = ["MemoryBackfill"]

_CLEAR_BATCH = 1000  # memories per clean-up transaction
# Memories a space's backfill reads at once (handed to the embedder a batch at a time): on Citus
# each read is a multi-shard statement of seconds, paid per few hundred memories so.
_MEMORY_READ = 256


class MemoryBackfill:
    """Memories in batches of the embedder's size, each batch written with the cursor and the
    progress by `runner_id` (whose lease each write extends by `lease_seconds`)."""

    rows = "memories"
    clear_limit = _CLEAR_BATCH

    def __init__(self, store: MemoryBackfillStore, *, runner_id: str, lease_seconds: float):
        self._store = store
        self._runner_id = runner_id
        self._lease_seconds = lease_seconds

    async def backfill(
        self, migration: MemorySpaceMigration, embedder: ScheduledEmbedder, size: int, pipeline: BatchPipeline
    ) -> None:
        read = _ReadAhead(self._store, batch=size, rows=max(size, _MEMORY_READ)).read
        demand = bulk_demand(migration)

        async def embed(batch: list[PendingMemory]) -> np.ndarray:
            return await embed_texts(embedder, [p.content for p in batch], demand, span="reembedding.batch")

        async def store(
            at: MemorySpaceMigration, batch: list[PendingMemory], vectors: np.ndarray
        ) -> MemorySpaceMigration | None:
            rows = list(zip(batch, vectors, strict=True))
            stored = await self._store.store_vectors(
                at, self._runner_id, rows, lease_seconds=self._lease_seconds
            )
            if stored is not None:
                METRICS.migration_rows.labels(at.target.name).inc(len(rows))
            return stored

        await pipeline.pipeline(
            migration,
            read=read,
            ahead_of=lambda at, batch: replace(at, cursor=(batch[-1].bucket, batch[-1].id)),
            embed=embed,
            store=store,
        )


class _ReadAhead:
    """A space's pending memories read `rows` at a time and handed out a `batch` at a time. A
    read continues the batch handed out before only when the cursor is that batch's end; from any
    other cursor (a rewind to the start, a retried batch) it reads the store again. The rows held
    may go stale (changed or forgotten since): the store's write skips those, as it does for a
    single batch read ahead, and the next pass catches what changed."""

    def __init__(self, store: MemoryBackfillStore, *, batch: int, rows: int):
        self._store = store
        self._batch = batch
        self._rows = rows
        self._held: list[PendingMemory] = []
        self._held_after: tuple[str, str] | None = None  # the cursor `_held` continues

    async def read(self, at: MemorySpaceMigration) -> list[PendingMemory]:
        if at.cursor is None or at.cursor != self._held_after or not self._held:
            self._held = await self._store.pending(at, limit=self._rows)
        batch, self._held = self._held[: self._batch], self._held[self._batch :]
        if batch:
            self._held_after = (batch[-1].bucket, batch[-1].id)
        return batch
