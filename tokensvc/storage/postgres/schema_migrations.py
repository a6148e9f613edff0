"""Schema migrations: numbered SQL files applied in order, once, under an advisory lock.

All pending files run in one transaction that first takes a transaction-scoped advisory lock, so
concurrent `tokensvc migrate` runs (two replicas starting together) serialise and the second
finds nothing to do. Each applied file is recorded with its checksum; an applied file that later
changes is an error rather than a silent drift.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

from tokensvc.names import is_sql_identifier

__all__ = [
    "LOCK_ID",
    "MINIMUM_PGVECTOR",
    "MINIMUM_POSTGRES",
    "SchemaMigration",
    "SchemaMigrationError",
    "apply_schema_migrations",
    "available_schema_migrations",
    "schema_version",
]

# The oldest servers tokensvc runs on (checked before the first migration).
MINIMUM_POSTGRES = 15
MINIMUM_PGVECTOR = (0, 8, 0)
# Arbitrary but fixed: the lock id every tokensvc process agrees on.
LOCK_ID = 0x746F6B656E737663  # "tokensvc"
_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


class SchemaMigrationError(RuntimeError):
    """A schema migration cannot be applied, or the recorded history disagrees with the files."""


@dataclass(frozen=True)
class SchemaMigration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def available_schema_migrations() -> list[SchemaMigration]:
    """The migration files shipped in the package, in version order."""
    found = []
    for entry in resources.files("tokensvc.storage.postgres").joinpath("migrations").iterdir():
        match = _FILE_NAME.fullmatch(entry.name)
        if match:
            found.append(SchemaMigration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda migration: migration.version)
    versions = [migration.version for migration in found]
    if versions != list(range(1, len(found) + 1)):
        raise SchemaMigrationError(f"migration versions must be 1..n without gaps, found {versions}")
    return found


_BOOKKEEPING = """
CREATE SCHEMA IF NOT EXISTS tokensvc;
CREATE TABLE IF NOT EXISTS tokensvc.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


async def apply_schema_migrations(
    conn: asyncpg.Connection, *, app_role: str, runner_role: str = "tokensvc_runner"
) -> list[SchemaMigration]:
    """Apply every pending migration; returns those applied (empty when up to date).

    `{app_role}` in a file is the serving group role, `{runner_role}` the re-embedding runner's
    (0021 on), both checked to be plain identifiers first."""
    for what, role in (("app", app_role), ("runner", runner_role)):
        if not is_sql_identifier(role):
            raise SchemaMigrationError(f"{what} role {role!r} is not a plain SQL identifier")
    migrations = available_schema_migrations()
    applied: list[SchemaMigration] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        await _check_pgvector(conn)
        await conn.execute(_BOOKKEEPING)
        recorded = {
            row["version"]: row["checksum"]
            for row in await conn.fetch("SELECT version, checksum FROM tokensvc.schema_migrations")
        }
        for migration in migrations:
            if migration.version in recorded:
                if recorded[migration.version] != migration.checksum:
                    raise SchemaMigrationError(
                        f"migration {migration.version:04d}_{migration.name} was changed after it "
                        "was applied; add a new migration instead"
                    )
                continue
            await conn.execute(
                migration.sql.replace("{app_role}", app_role).replace("{runner_role}", runner_role)
            )
            await conn.execute(
                "INSERT INTO tokensvc.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                migration.version,
                migration.name,
                migration.checksum,
            )
            applied.append(migration)
        unknown = sorted(set(recorded) - {m.version for m in migrations})
        if unknown:
            raise SchemaMigrationError(
                f"the database has migrations {unknown} this tokensvc does not know; upgrade tokensvc"
            )
    return applied


async def schema_version(conn: asyncpg.Connection) -> int:
    """The highest applied migration, 0 when none (or the table is not readable yet)."""
    try:
        value = await conn.fetchval("SELECT max(version) FROM tokensvc.schema_migrations")
    except (
        asyncpg.UndefinedTableError,
        asyncpg.InvalidSchemaNameError,
        asyncpg.InsufficientPrivilegeError,
    ):
        return 0
    return int(value or 0)


async def _check_pgvector(conn: asyncpg.Connection) -> None:
    server = conn.get_server_version()
    if server.major < MINIMUM_POSTGRES:
        raise SchemaMigrationError(
            f"PostgreSQL {server.major} is too old; tokensvc needs >= {MINIMUM_POSTGRES}"
        )
    version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
    if version is None:
        available = await conn.fetchval(
            "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'"
        )
        if available is None:
            raise SchemaMigrationError(
                "pgvector is not installed on the database server; install pgvector >= 0.8"
            )
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except asyncpg.InsufficientPrivilegeError:
            raise SchemaMigrationError(
                "the pgvector extension is not created in this database and the migrating role may not "
                "create it; run `CREATE EXTENSION vector` as a superuser"
            ) from None
        version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
    parsed = tuple(int(part) for part in re.findall(r"\d+", str(version))[:3])
    if parsed < MINIMUM_PGVECTOR:
        raise SchemaMigrationError(
            f"pgvector {version} is too old; tokensvc needs >= {'.'.join(map(str, MINIMUM_PGVECTOR))} "
            "(ALTER EXTENSION vector UPDATE)"
        )
