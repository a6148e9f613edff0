"""Revocation storage in PostgreSQL (the contract: `tokensvc.storage.ports.RevocationStore`).

Contract:
- `revoke(kind, value, ...)` is idempotent: revoking twice keeps the first record and returns its
  time.
- `since(t)` returns every revocation whose `revoked_at >= t` (visible now); a row committed long
  after its `revoked_at` is missed by a window, which is why the poller also resyncs with `all()`.
- `all()` returns every revocation (start-up load and the periodic full resync).
- `listen(on_revocation)` LISTENs on a connection of its own (never a pooled one: LISTEN is
  session state) to the announcements of migration 0012's trigger, sent at commit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.records import Revocation, RevocationKind

__all__ = ["PostgresRevocationStore"]


CHANNEL = "tokensvc_revocations"

_log = logging.getLogger(__name__)


class _Feed:
    """One LISTEN connection; closed (and `is_open` False) when the connection is lost."""

    def __init__(self, conn: asyncpg.Connection, on_revocation: Callable[[Revocation], None]):
        self._conn = conn
        self._on_revocation = on_revocation

    async def start(self) -> None:
        self._conn.add_termination_listener(self._lost)
        await self._conn.add_listener(CHANNEL, self._notified)

    @property
    def is_open(self) -> bool:
        return not self._conn.is_closed()

    async def close(self) -> None:
        if not self._conn.is_closed():
            await self._conn.close()

    def _lost(self, conn: Any) -> None:
        _log.warning("the revocation announcements' connection was lost; polling meanwhile")

    def _notified(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        try:
            body = json.loads(str(payload))
            kind = body["kind"]
            if kind not in ("jti", "run"):
                raise ValueError("unknown kind")
            revoked = Revocation(kind, str(body["value"]), datetime.fromisoformat(body["revoked_at"]))
        except (ValueError, KeyError, TypeError):
            # Only the trigger sends on this channel; a malformed payload is dropped, the poll
            # still finds the row.
            _log.warning("malformed revocation announcement ignored")
            return
        self._on_revocation(revoked)


@translate_errors
class PostgresRevocationStore:
    def __init__(
        self, pool: asyncpg.Pool, connect: Callable[[], Awaitable[asyncpg.Connection]] | None = None
    ):
        self._pool = pool
        self._connect = connect

    async def listen(self, on_revocation: Callable[[Revocation], None]) -> _Feed:
        if self._connect is None:
            raise RuntimeError("this store was built without a way to open a connection of its own")
        feed = _Feed(await self._connect(), on_revocation)
        try:
            await feed.start()
        except BaseException:
            await feed.close()
            raise
        return feed

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
