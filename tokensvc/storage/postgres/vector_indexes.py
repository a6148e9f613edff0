"""HNSW builds left unfinished, found in the catalogue and finished partition by partition (the
contract: `tokensvc.storage.ports.VectorIndexMaintenance`).

A (slot, dimension) index is a parent index on `memories` (`memories_hnsw_D`, `memories_hnsw_b_D`)
that PostgreSQL marks valid once every partition's index is attached to it
(`ensure_memory_partition_index`, migration 0014). A parent that is not valid is a build that
something started and did not finish: a write of a new dimension on Citus (which starts builds
only), a replica that stopped mid-build, a re-embedding target. The catalogue says so without
reading any tenant's rows, so the serving role can find them all.
"""

from __future__ import annotations

import re

import asyncpg

from tokensvc.storage.postgres.errors import translate_errors
from tokensvc.storage.postgres.memories import ensure_vector_index

__all__ = ["PostgresVectorIndexes"]

# The parent indexes' names (migration 0014); any other index on memories is not ours to finish.
_PARENT = re.compile(r"memories_hnsw_(b_)?([1-9][0-9]*)")


@translate_errors
class PostgresVectorIndexes:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def unfinished(self) -> list[tuple[int, int]]:
        async with self._pool.acquire() as conn:
            names = await conn.fetch(
                "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE i.indrelid = to_regclass('tokensvc.memories') AND NOT i.indisvalid"
            )
        found = []
        for (name,) in names:
            if (match := _PARENT.fullmatch(name)) is not None:
                found.append((int(match[2]), 1 if match[1] else 0))
        return sorted(found)

    async def finish(self, dimension: int, slot: int) -> None:
        await ensure_vector_index(self._pool, dimension, slot)
