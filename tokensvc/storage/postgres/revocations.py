"""Revocation storage in PostgreSQL (the contract: `tokensvc.storage.ports.RevocationStore`).

Contract:
- `revoke(kind, value, ...)` is idempotent: revoking twice keeps the first record and returns its
  time.
- `since(t)` returns every revocation whose `revoked_at >= t` (visible now); a row committed long
  after its `revoked_at` is missed by a window, which is why the poller also resyncs with `all()`.
- `all()` returns every revocation (start-up load and the periodic full resync).
- `since` and `all` report the database's `now()` of the statement that read the rows, in the
  same statement: the reader's watermark follows the database's clock, never a row's time.
- `find(keys)` reads the rows an announcement names.
- `listen(on_announced)` LISTENs on a connection of its own (never a pooled one: LISTEN is
  session state) to the announcements of migration 0012's trigger, sent at commit. Any role may
  NOTIFY on the channel, so only (kind, value) is taken from a payload, as a hint.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from datetime import datetime
from typing import Any

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.records import Revocation, RevocationKind, RevocationSnapshot
from tokensvc.untrusted_json import UntrustedJsonError, parse

__all__ = ["PostgresRevocationStore"]


CHANNEL = "tokensvc_revocations"
_MAX_PAYLOAD = 8000  # PostgreSQL's own bound on a NOTIFY payload
# One statement, so `as_of` is the clock of the snapshot the rows come from: one row carries it
# (and nothing else), the others are revocations. One line: tests read the statement log by line.
_SINCE = (
    "SELECT NULL::text AS kind, NULL::text AS value, NULL::timestamptz AS revoked_at, now() AS as_of"
    " UNION ALL SELECT kind, value, revoked_at, NULL FROM capability_revocations WHERE revoked_at >= $1"
)
_ALL = (
    "SELECT NULL::text AS kind, NULL::text AS value, NULL::timestamptz AS revoked_at, now() AS as_of"
    " UNION ALL SELECT kind, value, revoked_at, NULL FROM capability_revocations"
)

_log = logging.getLogger(__name__)


class _Feed:
    """One LISTEN connection; closed (and `is_open` False) when the connection is lost."""

    def __init__(self, conn: asyncpg.Connection, on_announced: Callable[[RevocationKind, str], None]):
        self._conn = conn
        self._on_announced = on_announced

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
        # Any role can send on this channel: only the key is taken, and the caller reads its row.
        try:
            body = parse(str(payload), max_bytes=_MAX_PAYLOAD)
            kind, value = body["kind"], body["value"]
            if kind not in ("jti", "run") or not isinstance(value, str):
                raise ValueError("not a revocation's key")
        except (UntrustedJsonError, ValueError, KeyError, TypeError):
            _log.warning("malformed revocation announcement ignored")
            return
        self._on_announced(kind, value)


@translate_errors
class PostgresRevocationStore:
    def __init__(
        self, pool: asyncpg.Pool, connect: Callable[[], Awaitable[asyncpg.Connection]] | None = None
    ):
        self._pool = pool
        self._connect = connect

    async def listen(self, on_announced: Callable[[RevocationKind, str], None]) -> _Feed:
        if self._connect is None:
            raise RuntimeError("this store was built without a way to open a connection of its own")
        feed = _Feed(await self._connect(), on_announced)
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

    async def since(self, moment: datetime) -> RevocationSnapshot:
        async with self._pool.acquire() as conn:
            return _snapshot(await conn.fetch(_SINCE, moment))

    async def all(self) -> RevocationSnapshot:
        async with self._pool.acquire() as conn:
            return _snapshot(await conn.fetch(_ALL))

    async def find(self, keys: Collection[tuple[RevocationKind, str]]) -> list[Revocation]:
        if not keys:
            return []
        kinds, values = zip(*keys, strict=True)
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT kind, value, revoked_at FROM capability_revocations"
                " WHERE (kind, value) IN (SELECT * FROM unnest($1::text[], $2::text[]))",
                list(kinds),
                list(values),
            )
        return [Revocation(row["kind"], row["value"], row["revoked_at"]) for row in rows]


def _snapshot(rows: list[asyncpg.Record]) -> RevocationSnapshot:
    # Told apart by `as_of`, not by position: SQL does not promise UNION ALL's order.
    (as_of,) = [row["as_of"] for row in rows if row["as_of"] is not None]
    revocations = (
        Revocation(row["kind"], row["value"], row["revoked_at"]) for row in rows if row["as_of"] is None
    )
    return RevocationSnapshot(tuple(revocations), as_of)
