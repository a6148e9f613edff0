"""Revocation storage in PostgreSQL (the contract: `tokensvc.storage.ports.RevocationStore`).

Contract:
- `revoke(kind, value, ...)` is idempotent: revoking twice keeps the first record and returns its
  time.
- `since(t)` returns every revocation whose `revoked_at >= t` (visible now); a row committed long
  after its `revoked_at` is missed by a window, which is why the poller also resyncs with `all()`.
- `all()` returns every revocation (start-up load and the periodic full resync).
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.records import Revocation, RevocationKind

__all__ = ["PostgresRevocationStore"]


@translate_errors
class PostgresRevocationStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        async with self._pool.acquire() as conn:
            revoked_at: datetime = await conn.fetchval(
                """
                WITH inserted AS (
                    INSERT INTO capability_revocations (kind, value, reason, revoked_by)
                    VALUES ($1, $2, $3, $4)
                    ON CONFLICT (kind, value) DO NOTHING
                    RETURNING revoked_at
                )
                SELECT revoked_at FROM inserted
                UNION ALL
                SELECT revoked_at FROM capability_revocations WHERE kind = $1 AND value = $2
                LIMIT 1
                """,
                kind,
                value,
                reason,
                revoked_by,
            )
            if revoked_at is None:
                # A concurrent revocation of the same value won: the insert waited for it and did
                # nothing, but this statement's snapshot predates its commit. A new one sees it.
                revoked_at = await conn.fetchval(
                    "SELECT revoked_at FROM capability_revocations WHERE kind = $1 AND value = $2",
                    kind,
                    value,
                )
        return revoked_at

    async def since(self, moment: datetime) -> list[Revocation]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT kind, value, revoked_at FROM capability_revocations WHERE revoked_at >= $1",
                moment,
            )
        return [Revocation(row["kind"], row["value"], row["revoked_at"]) for row in rows]

    async def all(self) -> list[Revocation]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch("SELECT kind, value, revoked_at FROM capability_revocations")
        return [Revocation(row["kind"], row["value"], row["revoked_at"]) for row in rows]
