"""Transactions bound to a tenant: the second wall behind every query's own bucket predicate.

Row-level security policies read `tokensvc.buckets`, `tokensvc.namespace` and `tokensvc.agent`;
we set them with `set_config(..., true)`, which lasts only until the transaction ends, so a
pooled connection never carries a previous request's tenant into the next one.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg

__all__ = ["Tenant", "tenant_transaction"]

_BUCKET = re.compile(r"^v[1-9][0-9]{0,8}\.[a-z2-7]{1,128}$")


@dataclass(frozen=True)
class Tenant:
    namespace: str
    agent: str
    buckets: Sequence[str] = ()

    def __post_init__(self) -> None:
        for bucket in self.buckets:
            # RLS splits the list on commas: a bucket id must never contain one.
            if not _BUCKET.match(bucket):
                raise ValueError("not a bucket id")


@asynccontextmanager
async def tenant_transaction(
    pool: asyncpg.Pool, tenant: Tenant, *, isolation: str = "read_committed"
) -> AsyncIterator[asyncpg.Connection]:
    async with pool.acquire() as conn, conn.transaction(isolation=isolation):  # type: ignore[arg-type]
        await conn.execute(
            "SELECT set_config('tokensvc.buckets', $1, true), "
            "set_config('tokensvc.namespace', $2, true), set_config('tokensvc.agent', $3, true)",
            ",".join(tenant.buckets),
            tenant.namespace,
            tenant.agent,
        )
        yield conn  # type: ignore[misc]
