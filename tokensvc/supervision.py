"""Background duties of a running tokensvc: database health, embedded-PostgreSQL supervision,
the expired-memory sweeper and the per-space memory gauge.

Health follows the database: when it cannot be reached, every service turns NOT_SERVING (load
balancers stop sending traffic) and RPCs fail fast with UNAVAILABLE; when it returns, stale
pooled connections are dropped and health turns SERVING again. In embedded mode a dead
PostgreSQL is restarted on the same port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import asyncpg
from grpc_health.v1 import health_pb2

from tokensvc.memory.service import LongTermMemory
from tokensvc.observability.metrics import METRICS
from tokensvc.storage.postgres.embedded import EmbeddedPostgres

__all__ = ["HealthMonitor", "refresh_memory_gauge_forever", "sweep_forever"]

_log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        health: Any,
        services: Sequence[str],
        *,
        embedded: EmbeddedPostgres | None,
        interval: float,
        probe_timeout: float,
    ):
        self._pool = pool
        self._health = health
        self._services = ("", *services)
        self._embedded = embedded
        self._interval = interval
        self._timeout = probe_timeout
        self.serving = True

    async def probe(self) -> bool:
        try:
            async with self._pool.acquire(timeout=self._timeout) as conn:
                try:
                    await conn.fetchval("SELECT 1", timeout=self._timeout)
                except TimeoutError:
                    # A hung server never answers the cancel request that returning this connection
                    # to the pool waits for (the probe would hang with it): drop the connection.
                    conn.terminate()
                    raise
        except (
            TimeoutError,
            OSError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
        ):
            return False
        return True

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
                await self._pool.expire_connections()
                healthy = await self.probe()
        await self._set_serving(healthy)

    async def _set_serving(self, healthy: bool) -> None:
        if healthy == self.serving:
            return
        self.serving = healthy
        if healthy:
            # Connections made to the previous server process are dead; drop them all now.
            await self._pool.expire_connections()
        status = (
            health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._services:
            await self._health.set(name, status)
        _log.warning(
            "database %s; health is %s",
            "reachable" if healthy else "unreachable",
            "SERVING" if healthy else "NOT_SERVING",
        )


async def sweep_forever(memory: LongTermMemory, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            swept = await memory.sweep_expired()
        except Exception as exc:
            _log.warning("memory sweep failed", extra={"error": type(exc).__name__})
            continue
        if swept:
            _log.info("expired memories deleted", extra={"count": swept})


async def refresh_memory_gauge_forever(pool: asyncpg.Pool, interval: float) -> None:
    """Memories per (namespace, agent) for the tokensvc_memories gauge; counts only."""
    while True:
        try:
            async with pool.acquire() as conn:
                rows = await conn.fetch("SELECT namespace, agent, row_count FROM memory_rows_by_space()")
            METRICS.live.memories_per_space = {(r[0], r[1]): int(r[2]) for r in rows}
        except Exception as exc:
            _log.debug("memory gauge refresh failed", extra={"error": type(exc).__name__})
        await asyncio.sleep(interval)
