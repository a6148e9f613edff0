"""End-user data rights in process memory (the contract: `tokensvc.storage.ports.DataSubjectStore`),
over the rows of one `InProcessMemoryStore`.

The same semantics as `tokensvc.storage.postgres.data_subjects`, checked by the conformance suite:
only the tenant's declared buckets are touched, rows are visited in (bucket, created_at, id)
order, and receipts are kept as recorded.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import datetime

from tokensvc.storage.inprocess.memories import InProcessMemoryStore
from tokensvc.storage.records import DataSubjectReceipt, ExportedMemory, Tenant

__all__ = ["InProcessDataSubjectStore"]


class InProcessDataSubjectStore:
    def __init__(self, memories: InProcessMemoryStore):
        self._memories = memories
        self._receipts: dict[str, DataSubjectReceipt] = {}

    async def agents(
        self, namespace: str | None, *, after: tuple[str, str] | None, limit: int
    ) -> list[tuple[str, str]]:
        spaces = sorted(
            key
            for key in self._memories.tables.spaces
            if (namespace is None or key[0] == namespace) and (after is None or key > after)
        )
        return spaces[:limit]

    async def erase(self, tenant: Tenant, *, limit: int) -> int:
        async with self._memories.tables.lock:
            erased = 0
            for bucket in tenant.buckets:
                rows = self._memories.tables.rows.get(bucket, {})
                for memory_id in list(rows)[: limit - erased]:
                    del rows[memory_id]
                    erased += 1
                if erased == limit:
                    break
            return erased

    async def export(
        self, tenant: Tenant, *, after: tuple[str, datetime, str] | None, limit: int
    ) -> list[ExportedMemory]:
        now = self._memories.tables.clock.now()
        rows = sorted(
            (row for bucket in tenant.buckets for row in self._memories.tables.rows.get(bucket, {}).values()),
            key=lambda row: (row.bucket, row.created_at, row.id),
        )
        found = [
            ExportedMemory(tenant.namespace, tenant.agent, row.bucket, row.record(""))
            for row in rows
            if row.live(now) and (after is None or (row.bucket, row.created_at, row.id) > after)
        ]
        return found[:limit]

    async def record_receipt(self, receipt: DataSubjectReceipt) -> DataSubjectReceipt:
        stored = replace(receipt, id=str(uuid.UUID(receipt.id)), created_at=self._memories.tables.clock.now())
        self._receipts[stored.id] = stored
        return stored

    async def receipt(self, receipt_id: str) -> DataSubjectReceipt | None:
        return self._receipts.get(str(uuid.UUID(receipt_id)))
