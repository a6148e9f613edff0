"""Audit trail storage (append-only): the contract and its PostgreSQL implementation.

Contract: `append` records one event and returns its id; `page` returns events newest first,
strictly older than the cursor id, filtered by kinds and a time window.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.records import AuditRecord

__all__ = ["PostgresAuditStore"]


@translate_errors
class PostgresAuditStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def append(
        self, *, kind: str, actor: str, action: str, target: str, outcome: str, reason: str, detail: str
    ) -> int:
        async with self._pool.acquire() as conn:
            value = await conn.fetchval(
                "INSERT INTO audit_events (kind, actor, action, target, outcome, reason, detail) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
                kind,
                actor,
                action,
                target,
                outcome,
                reason,
                detail[:2048],
            )
        return int(value)

    async def page(
        self,
        *,
        before_id: int | None,
        kinds: Sequence[str],
        since: datetime | None,
        until: datetime | None,
        limit: int,
    ) -> list[AuditRecord]:
        clauses = ["true"]
        params: list[Any] = []
        if before_id is not None:
            params.append(before_id)
            clauses.append(f"id < ${len(params)}")
        if kinds:
            params.append(list(kinds))
            clauses.append(f"kind = ANY(${len(params)}::text[])")
        if since is not None:
            params.append(since)
            clauses.append(f"occurred_at >= ${len(params)}")
        if until is not None:
            params.append(until)
            clauses.append(f"occurred_at < ${len(params)}")
        params.append(limit)
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT id, occurred_at, kind, actor, action, target, outcome, reason, detail FROM audit_events "
                f"WHERE {' AND '.join(clauses)} ORDER BY id DESC LIMIT ${len(params)}",
                *params,
            )
        return [AuditRecord(**dict(row)) for row in rows]
