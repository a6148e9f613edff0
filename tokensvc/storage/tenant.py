"""Transactions bound to a tenant: the second wall behind every query's own bucket predicate.

Row-level security policies read `tokensvc.buckets`, `tokensvc.namespace` and `tokensvc.agent`;
we set them with `set_config(..., true)`, which lasts only until the transaction ends, so a
pooled connection never carries a previous request's tenant into the next one.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg

from tokensvc.names import is_kb_ref
from tokensvc.observability.deadlines import remaining_ms

__all__ = ["ALL_KNOWLEDGE_BASES", "Tenant", "tenant_transaction"]

_BUCKET = re.compile(r"v[1-9][0-9]{0,8}\.[a-z2-7]{1,128}")


ALL_KNOWLEDGE_BASES = "*"
_ACQUIRE_CEILING_S = 30.0


@dataclass(frozen=True)
class Tenant:
    """What one transaction may see: a namespace, an agent's buckets, knowledge bases."""

    namespace: str
    agent: str = ""
    buckets: Sequence[str] = ()
    # Knowledge-base refs (a launcher's roster), or ("*",) for control-plane management.
    knowledge_bases: Sequence[str] = ()

    def __post_init__(self) -> None:
        # RLS splits these lists on commas: an element must never contain one.
        for bucket in self.buckets:
            if not _BUCKET.fullmatch(bucket):
                raise ValueError("not a bucket id")
        for ref in self.knowledge_bases:
            if ref != ALL_KNOWLEDGE_BASES and not is_kb_ref(ref):
                raise ValueError("not a knowledge base ref")


_TENANT_SETTINGS = (
    "SELECT set_config('tokensvc.buckets', $1, true), set_config('tokensvc.namespace', $2, true), "
    "set_config('tokensvc.agent', $3, true), set_config('tokensvc.kbs', $4, true), "
    "set_config('statement_timeout', coalesce($5, current_setting('statement_timeout')), true)"
)


@asynccontextmanager
async def tenant_transaction(
    pool: asyncpg.Pool,
    tenant: Tenant,
    *,
    isolation: str = "read_committed",
    settings: Mapping[str, str] | None = None,
) -> AsyncIterator[asyncpg.Connection]:
    """A transaction bound to `tenant`; `settings` are more transaction-local settings (e.g. the
    HNSW scan's), set by the same statement, so they cost no extra round trip."""
    extra = list((settings or {}).items())
    sql = _TENANT_SETTINGS + "".join(
        f", set_config(${6 + 2 * i}, ${7 + 2 * i}, true)" for i in range(len(extra))
    )
    # Waiting for a connection is bounded too: by the caller's deadline, else a fixed ceiling, so a
    # hung database cannot queue requests forever (the wait ends as UNAVAILABLE).
    left = remaining_ms()
    wait = _ACQUIRE_CEILING_S if left is None else min(left / 1000, _ACQUIRE_CEILING_S)
    async with pool.acquire(timeout=wait) as conn, conn.transaction(isolation=isolation):  # type: ignore[arg-type]
        await conn.execute(
            sql,
            ",".join(tenant.buckets),
            tenant.namespace,
            tenant.agent,
            ",".join(tenant.knowledge_bases),
            # The caller's deadline bounds every statement; without one the server default stays.
            None if (left := remaining_ms()) is None else str(left),
            *(value for pair in extra for value in pair),
        )
        yield conn  # type: ignore[misc]
