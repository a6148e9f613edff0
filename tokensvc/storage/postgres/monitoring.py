"""What operators and the supervisor read from PostgreSQL: memory counts and a health probe.

`PostgresStatistics` implements `tokensvc.storage.ports.MemoryStatistics` through the
security-definer functions `memory_rows_by_pepper_version()` and `memory_rows_by_space()` (counts
only; the serving role cannot read other tenants' rows directly). `PostgresHealth` implements
`DatabaseHealth` over the serving pool.
"""

from __future__ import annotations

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors

__all__ = ["PostgresHealth", "PostgresStatistics"]


@translate_errors
class PostgresStatistics:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def rows_by_pepper_version(self) -> dict[int, int]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch("SELECT pepper_version, row_count FROM memory_rows_by_pepper_version()")
        return {int(row[0]): int(row[1]) for row in rows}

    async def rows_by_space(self) -> dict[tuple[str, str], int]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch("SELECT namespace, agent, row_count FROM memory_rows_by_space()")
        return {(row[0], row[1]): int(row[2]) for row in rows}


class PostgresHealth:
    def __init__(self, pool: asyncpg.Pool, *, probe_timeout: float):
        self._pool = pool
        self._timeout = probe_timeout

    async def probe(self) -> bool:
        timeout = self._timeout
        try:
            async with self._pool.acquire(timeout=timeout) as conn:
                try:
                    await conn.fetchval("SELECT 1", timeout=timeout)
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

    async def reconnect(self) -> None:
        await self._pool.expire_connections()
