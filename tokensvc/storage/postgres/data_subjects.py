"""End-user data rights in PostgreSQL (the contract: `tokensvc.storage.ports.DataSubjectStore`).

The user's rows are reached through the tables' own row-level security: each call declares the
user's buckets as the transaction's (`tenant_transaction`), so a statement cannot touch another
user's rows whatever it says. The list of agents comes from the owner's `memory_space_agents`
(migration 0016), since no tenant may read across agents.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.memories import memory_record
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import (
    AgentMemories,
    DataSubjectReceipt,
    ExportedMemory,
    ReceiptKind,
    Tenant,
)

__all__ = ["PostgresDataSubjectStore"]

_LIVE = "(expires_at IS NULL OR expires_at > now())"


def _receipt(row: asyncpg.Record) -> DataSubjectReceipt:
    per_agent = json.loads(row["per_agent"]) if isinstance(row["per_agent"], str) else row["per_agent"]
    return DataSubjectReceipt(
        id=str(row["id"]),
        kind=ReceiptKind(row["kind"]),
        namespace=row["namespace"],
        memories=row["memories"],
        per_agent=tuple(AgentMemories(a["namespace"], a["agent"], a["memories"]) for a in per_agent),
        agents=row["agents"],
        key_prefixes=row["key_prefixes"],
        actor=row["actor"],
        created_at=row["created_at"],
        complete=row["complete"],
    )


@translate_errors
class PostgresDataSubjectStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def agents(
        self, namespace: str | None, *, after: tuple[str, str] | None, limit: int
    ) -> list[tuple[str, str]]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM memory_space_agents($1, $2, $3, $4)",
                namespace,
                None if after is None else after[0],
                None if after is None else after[1],
                limit,
            )
        return [(row["namespace"], row["agent"]) for row in rows]

    async def erase(self, tenant: Tenant, *, limit: int) -> int:
        async with tenant_transaction(self._pool, tenant) as conn:
            # The buckets are the declared ones (row-level security), named again so the planner
            # prunes to their partitions. By id alone (the same id in two of them is the same
            # memory mid-move, erased too): Citus cannot plan a row comparison with a subquery.
            result = await conn.execute(
                "DELETE FROM memories WHERE bucket = ANY($1::text[]) AND id IN "
                "(SELECT id FROM memories WHERE bucket = ANY($1::text[]) LIMIT $2)",
                list(tenant.buckets),
                limit,
            )
        return int(result.split()[-1])

    async def export(
        self, tenant: Tenant, *, after: tuple[str, datetime, str] | None, limit: int
    ) -> list[ExportedMemory]:
        params: list[Any] = [list(tenant.buckets), limit]
        where = ""
        if after is not None:
            params += list(after)
            where = 'AND (bucket COLLATE "C", created_at, id) > ($3, $4, $5::uuid) '
        async with tenant_transaction(self._pool, tenant) as conn:
            rows = await conn.fetch(
                "SELECT bucket, id, content, metadata, created_at, updated_at, expires_at FROM memories "
                f'WHERE bucket = ANY($1::text[]) AND {_LIVE} {where}ORDER BY bucket COLLATE "C", created_at, id LIMIT $2',
                *params,
            )
        return [
            ExportedMemory(tenant.namespace, tenant.agent, row["bucket"], memory_record(row, embedder=""))
            for row in rows
        ]

    async def record_receipt(self, receipt: DataSubjectReceipt) -> DataSubjectReceipt:
        per_agent = [
            {"namespace": a.namespace, "agent": a.agent, "memories": a.memories} for a in receipt.per_agent
        ]
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                "INSERT INTO data_subject_receipts (id, kind, namespace, memories, per_agent, agents, "
                "key_prefixes, actor, complete) VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9) RETURNING *",
                receipt.id,
                receipt.kind.value,
                receipt.namespace,
                receipt.memories,
                json.dumps(per_agent),
                receipt.agents,
                receipt.key_prefixes,
                receipt.actor,
                receipt.complete,
            )
        assert row is not None
        return _receipt(row)

    async def receipt(self, receipt_id: str) -> DataSubjectReceipt | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow("SELECT * FROM data_subject_receipts WHERE id = $1", receipt_id)
        return None if row is None else _receipt(row)
