"""Background duties of a running tokensvc: database health, embedded-PostgreSQL supervision,
the expired-memory sweeper, unfinished vector-index builds and the gauges read from the database.

Health follows the database: when it cannot be reached, every service turns NOT_SERVING (load
balancers stop sending traffic) and RPCs fail fast with UNAVAILABLE; when it returns, stale
pooled connections are dropped and health turns SERVING again. In embedded mode a dead
PostgreSQL is restarted on the same port. The monitor only decides; the app publishes the
decision to the gRPC health service (`publish`), so nothing here knows gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from tokensvc.memory.service import LongTermMemory
from tokensvc.observability.metrics import METRICS, ActiveMigration, DatabaseReadings, IngestionReadings
from tokensvc.storage.ports import (
    CredentialJournal,
    DatabaseHealth,
    DatabaseServer,
    IngestionStore,
    MemoryStatistics,
    MigrationOperationsStore,
    VectorIndexMaintenance,
)

__all__ = [
    "HealthMonitor",
    "finish_vector_indexes_forever",
    "read_database_gauges",
    "refresh_gauges_forever",
    "sweep_forever",
]

_log = logging.getLogger(__name__)

# Told whether tokensvc serves (True: SERVING) whenever that changes; the app sets gRPC health.
Publish = Callable[[bool], Awaitable[None]]


class HealthMonitor:
    def __init__(
        self,
        database: DatabaseHealth,
        publish: Publish,
        *,
        embedded: DatabaseServer | None,
        interval: float,
    ):
        self._database = database
        self._publish = publish
        self._embedded = embedded
        self._interval = interval
        self.serving = True

    async def probe(self) -> bool:
        return await self._database.probe()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_once()
            except Exception as exc:
                _log.warning("health check failed", extra={"error": type(exc).__name__})

    async def check_once(self) -> None:
        healthy = await self.probe()
        if not healthy and self._embedded is not None and self._embedded.postmaster_pid() is None:
            # NOT_SERVING for the whole restart (crash recovery can take a while), not only when it fails.
            await self._set_serving(False)
            _log.warning("the embedded PostgreSQL is not running; restarting it")
            try:
                await self._embedded.restart()
            except Exception as exc:
                _log.error("embedded PostgreSQL restart failed", extra={"error": str(exc)})
            else:
                # Pooled connections belong to the dead server: probe (and serve) on fresh ones.
                await self._database.reconnect()
                healthy = await self.probe()
        await self._set_serving(healthy)

    async def _set_serving(self, healthy: bool) -> None:
        if healthy == self.serving:
            return
        self.serving = healthy
        if healthy:
            # Connections made to the previous server process are dead; drop them all now.
            await self._database.reconnect()
        await self._publish(healthy)
        _log.warning(
            "database %s; health is %s",
            "reachable" if healthy else "unreachable",
            "SERVING" if healthy else "NOT_SERVING",
        )


async def sweep_forever(memory: LongTermMemory, interval: float) -> None:
    # Before the first sweep the alert measures from the start (a replica that never sweeps fires).
    METRICS.sweep_interval.set(interval)
    METRICS.sweep_last_success.set(time.time())
    while True:
        await asyncio.sleep(interval)
        try:
            swept = await memory.sweep_expired()
        except Exception as exc:
            METRICS.sweeps.labels("failed").inc()
            _log.warning("memory sweep failed", extra={"error": type(exc).__name__})
            continue
        METRICS.sweeps.labels("succeeded").inc()
        METRICS.swept.inc(swept)
        METRICS.sweep_last_success.set(time.time())
        if swept:
            _log.info("expired memories deleted", extra={"count": swept})


async def finish_vector_indexes_forever(indexes: VectorIndexMaintenance, interval: float) -> None:
    """Finish every vector-index build that was started and not finished, now and every
    `interval` seconds: a new dimension's on Citus (its first write only starts it), one a stopped
    replica left half done. Every replica does this; two on the same index build each partition
    once."""
    while True:
        try:
            for dimension, slot in await indexes.unfinished():
                _log.info("finishing a vector index", extra={"dimension": dimension, "slot": slot})
                started = time.monotonic()
                await indexes.finish(dimension, slot)
                _log.info(
                    "vector index finished",
                    extra={
                        "dimension": dimension,
                        "slot": slot,
                        "seconds": round(time.monotonic() - started, 1),
                    },
                )
        except Exception as exc:
            _log.warning("vector index build failed", extra={"error": type(exc).__name__})
        await asyncio.sleep(interval)


async def read_database_gauges(
    statistics: MemoryStatistics,
    journals: Sequence[CredentialJournal],
    migrations: MigrationOperationsStore,
    ingestion: IngestionStore | None = None,
) -> DatabaseReadings:
    """Memories per space, open credential rotations (of every credential's journal), unfinished
    migrations and the ingestion queue: counts and times, never content."""
    spaces = await statistics.rows_by_space()
    queue = None if ingestion is None else await ingestion.queue()
    open_rotations = [entry for journal in journals for entry in await journal.open_rotations()]
    active = await migrations.active()
    return DatabaseReadings(
        memories_per_space=spaces,
        open_rotations=len(open_rotations),
        oldest_open_rotation_started=min((r.started_at.timestamp() for r in open_rotations), default=0.0),
        migrations=tuple(
            ActiveMigration(
                id=m.id,
                kind=m.kind,
                state=m.state.value,
                rows_done=m.rows_done,
                rows_total=m.rows_total,
            )
            for m in active
        ),
        ingestion=None
        if queue is None
        else IngestionReadings(queue.pending, queue.processing, queue.failed, queue.oldest_seconds),
    )


async def refresh_gauges_forever(
    statistics: MemoryStatistics,
    journals: Sequence[CredentialJournal],
    migrations: MigrationOperationsStore,
    interval: float,
    ingestion: IngestionStore | None = None,
) -> None:
    """Keep `METRICS.live.database` current (every replica reads the same rows: rules take max)."""
    while True:
        try:
            METRICS.live.database = await read_database_gauges(statistics, journals, migrations, ingestion)
        except Exception as exc:
            _log.debug("database gauge refresh failed", extra={"error": type(exc).__name__})
        await asyncio.sleep(interval)
