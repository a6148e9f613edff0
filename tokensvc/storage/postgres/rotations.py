"""The credential rotation journal in PostgreSQL: `tokensvc.storage.ports.CredentialJournal`.

Each step is recorded *before* it is taken; after a crash the last recorded step says how far the
rotation may have got, and recovery rolls it forward or back. No secret is ever written here.
The serving and the runner credential (migration 0022) each have their own line of rotations and
versions in the one table: a journal reads and writes its credential's rows only.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.records import RotationEntry

__all__ = ["CREDENTIALS", "PostgresRotationJournal"]

# Whose rotations a journal keeps: the serving pool's login, the re-embedding runner's.
CREDENTIALS = ("serving", "runner")


_COLUMNS = "id, mode, actor, from_role, to_role, step, outcome, reason, version, started_at, updated_at"


@translate_errors
class PostgresRotationJournal:
    def __init__(self, pool: asyncpg.Pool, credential: str = "serving"):
        if credential not in CREDENTIALS:
            raise ValueError(f"credential must be one of {CREDENTIALS}, not {credential!r}")
        self._pool = pool
        self._credential = credential

    async def begin(self, *, mode: str, actor: str, from_role: str, to_role: str) -> int:
        async with self._pool.acquire() as conn:
            value = await conn.fetchval(
                "INSERT INTO credential_rotations (credential, mode, actor, from_role, to_role, step, outcome) "
                "VALUES ($1, $2, $3, $4, $5, 'started', 'in_progress') RETURNING id",
                self._credential,
                mode,
                actor,
                from_role,
                to_role,
            )
        return int(value)

    async def step(self, rotation_id: int, step: str) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(
                "UPDATE credential_rotations SET step = $2, updated_at = clock_timestamp() "
                "WHERE id = $1 AND credential = $3",
                rotation_id,
                step,
                self._credential,
            )

    async def close(
        self,
        rotation_id: int,
        *,
        outcome: str,
        reason: str = "",
        step: str | None = None,
        keep_version: bool = False,
    ) -> int | None:
        """Close a rotation; one that changed the credential gets the next credential version."""
        async with self._pool.acquire() as conn, conn.transaction():
            version = None
            if outcome in ("succeeded", "recovered") and not keep_version:
                # Serialised by the rotation lock; max()+1 is the next version.
                version = int(
                    await conn.fetchval(
                        "SELECT coalesce(max(version), 0) + 1 FROM credential_rotations WHERE credential = $1",
                        self._credential,
                    )
                )
            await conn.execute(
                "UPDATE credential_rotations SET outcome = $2, reason = $3, version = $4, "
                "step = coalesce($5, step), updated_at = clock_timestamp() WHERE id = $1 AND credential = $6",
                rotation_id,
                outcome,
                reason,
                version,
                step,
                self._credential,
            )
        return version

    async def open_rotations(self) -> list[RotationEntry]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS} FROM credential_rotations WHERE credential = $1 AND outcome = 'in_progress' "
                "ORDER BY id",
                self._credential,
            )
        return [RotationEntry(**dict(row)) for row in rows]

    async def snapshot(self) -> tuple[int, datetime | None, RotationEntry | None]:
        """The credential version, when it was set, and the latest rotation: one consistent read."""
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            version, rotated_at = await self._current_version(conn)
            row = await conn.fetchrow(
                f"SELECT {_COLUMNS} FROM credential_rotations WHERE credential = $1 ORDER BY id DESC LIMIT 1",
                self._credential,
            )
        return version, rotated_at, None if row is None else RotationEntry(**dict(row))

    async def _current_version(
        self, conn: PoolConnectionProxy[asyncpg.Record]
    ) -> tuple[int, datetime | None]:
        row = await conn.fetchrow(
            "SELECT version, updated_at FROM credential_rotations WHERE credential = $1 "
            "AND version IS NOT NULL ORDER BY version DESC LIMIT 1",
            self._credential,
        )
        return (0, None) if row is None else (int(row["version"]), row["updated_at"])
