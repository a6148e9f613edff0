"""Citus: how tokensvc's tables are placed on a cluster, and the step of `migrate` that places them.

A database whose `citus` extension exists is a Citus coordinator. Each tenant table is
distributed by the column that starts its primary key and that every tenant query names, so a
query for one tenant is a router query to one shard:

- `memories` by `bucket` (one user's rows on one shard; each shard keeps the 256 hash partitions
  of migration 0013);
- `knowledge_bases`, `documents` and `chunks` by `namespace`, co-located with the ingestion queue
  and the bases' text statistics, so a document's atomic version swap and a search's joins stay
  on one node.

`memory_spaces` and `embedding_migrations` become reference tables (a copy on every node): the
memories' generation trigger reads them on the worker that holds the row. The rest stays on the
coordinator as plain tables, never joined with tenant rows: the revocation list (its NOTIFY
trigger wakes the replicas listening on the coordinator), the rotation journal, the audit trail,
data-subject receipts and the migration history.

Placement runs after the SQL migrations, one table per transaction under the migrations' lock, and
skips a table already placed, so it is idempotent and a later migration's DDL on a distributed
table simply goes through the coordinator, which Citus forwards to every shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import asyncpg

from tokensvc.storage.postgres.schema_migrations import SchemaMigrationError

__all__ = ["PLACEMENTS", "SHARD_COUNT", "Placement", "citus_version", "distribute"]

_log = logging.getLogger(__name__)

SHARD_COUNT = 32


@dataclass(frozen=True)
class Placement:
    """Where one table goes: `column` distributes it (None: a reference table)."""

    table: str
    column: str | None = None
    colocate_with: str | None = None

    def shape(self) -> tuple[str, str | None]:
        """(Citus's partition method, the distribution column) once placed."""
        return ("n", None) if self.column is None else ("h", self.column)

    def statement(self) -> str:
        name = f"tokensvc.{self.table}"
        if self.column is None:
            return f"SELECT create_reference_table('{name}')"
        if self.colocate_with is None:
            return f"SELECT create_distributed_table('{name}', '{self.column}', shard_count => {SHARD_COUNT})"
        return (
            f"SELECT create_distributed_table('{name}', '{self.column}', "
            f"colocate_with => 'tokensvc.{self.colocate_with}')"
        )


# In dependency order: a reference table before the tables whose triggers read it, a table before
# those co-located with it (and holding foreign keys to it).
PLACEMENTS = (
    Placement("memory_spaces"),
    Placement("embedding_migrations"),
    Placement("memories", "bucket"),
    Placement("knowledge_bases", "namespace"),
    Placement("documents", "namespace", "knowledge_bases"),
    Placement("chunks", "namespace", "knowledge_bases"),
    Placement("ingestions", "namespace", "knowledge_bases"),
    Placement("ingestion_content", "namespace", "knowledge_bases"),
    Placement("ingestion_chunks", "namespace", "knowledge_bases"),
    Placement("text_statistics", "namespace", "knowledge_bases"),
    Placement("common_lexemes", "namespace", "knowledge_bases"),
)


async def citus_version(conn: asyncpg.Connection) -> str | None:
    """The Citus extension's version in this database, None when it is not a Citus database."""
    version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
    return None if version is None else str(version)


async def distribute(conn: asyncpg.Connection, lock_id: int) -> list[str]:
    """Place every table not yet placed; returns the tables placed now (empty when all were).

    Runs as the schema owner. `lock_id` is the migrations' advisory lock: two `migrate` runs
    place each table once.
    """
    placed: list[str] = []
    for placement in PLACEMENTS:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_id)
            name = f"tokensvc.{placement.table}"
            placed_as = await conn.fetchrow(
                "SELECT partmethod::text AS partmethod, column_to_column_name(logicalrelid, partkey) AS column"
                " FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)",
                name,
            )
            if placed_as is not None:
                if (placed_as["partmethod"], placed_as["column"]) != placement.shape():
                    raise SchemaMigrationError(
                        f"{name} is placed as ({placed_as['partmethod']}, {placed_as['column']}), "
                        f"not as tokensvc places it {placement.shape()}; undistribute it first"
                    )
                continue
            # Citus would copy a table's rows with COPY, which row-level security refuses, and
            # keep the local copy: only an empty table is placed.
            if await conn.fetchval(f"SELECT EXISTS (SELECT FROM {name})"):
                raise SchemaMigrationError(
                    f"{name} holds rows: migrate places an empty schema only (moving a populated "
                    "database onto Citus is not supported)"
                )
            # The generation guards are triggers that read reference tables on the shard's own
            # node, which Citus runs; it asks for this opt-in to create a table with triggers.
            await conn.execute("SET LOCAL citus.enable_unsafe_triggers = on")
            # In a transaction block Citus would open a connection per shard and partition at once
            # (32 x 256 for memories) and fail; one connection per worker, one table at a time.
            await conn.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
            _log.info("citus: placing tokensvc.%s", placement.table)
            await conn.execute(placement.statement())
            placed.append(placement.table)
    return placed
