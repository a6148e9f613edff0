"""Schema migrations: numbered SQL files applied in order, once, then the function files.

Numbered files (`migrations/NNNN_name.sql`) change tables, indexes, grants and policies; each is
applied once and frozen from then on: an applied file that later changes is an error rather than
a silent drift. Every SQL function lives in exactly one file under `migrations/functions/` (one
per family, with the triggers and grants that go with its functions) holding its current body,
written with `CREATE OR REPLACE`: a function file is applied whenever its checksum differs from the
one last applied (Flyway's repeatable migrations), and all of them after any numbered file ran,
since a numbered file may drop or change what a function relies on.

Everything runs in one transaction that first takes a transaction-scoped advisory lock, so
concurrent `tokensvc migrate` runs (two replicas starting together) serialise and the second
finds nothing to do.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import asyncpg

from tokensvc.names import is_sql_identifier

__all__ = [
    "LEGACY_CHECKSUMS",
    "LOCK_ID",
    "MINIMUM_PGVECTOR",
    "MINIMUM_POSTGRES",
    "SchemaFunctions",
    "SchemaMigration",
    "SchemaMigrationError",
    "apply_schema_migrations",
    "available_schema_functions",
    "available_schema_migrations",
    "schema_version",
]

# The oldest servers tokensvc runs on (checked before the first migration).
MINIMUM_POSTGRES = 15
MINIMUM_PGVECTOR = (0, 8, 0)
# Arbitrary but fixed: the lock id every tokensvc process agrees on.
LOCK_ID = 0x746F6B656E737663  # "tokensvc"
_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
_FUNCTIONS_FILE_NAME = re.compile(r"([a-z0-9_]+)\.sql")
_ONLY_COMMENTS = re.compile(r"(\s*--[^\n]*)*\s*")
_MIGRATIONS = resources.files("tokensvc.storage.postgres").joinpath("migrations")

# The numbered files that held function bodies until those moved to `functions/` (version ->
# checksum as released): a database they migrated holds what today's files of the same versions
# hold, plus the functions, which today's function files then define again, identically
# (tests/storage/test_schema_functions.py). Such a row is accepted and recorded anew.
LEGACY_CHECKSUMS = {
    3: "141d56e28577361302b43654ef82a4918c082184e28ba3dae8be56f9b98118ae",
    4: "52a44d936df700fe04cbc859bb3521b45e83b81d4b0cce67ba2935c2313d4544",
    6: "f27b1dbd3713a9fbd788a3af87ea87837ea0e8e816cafd19a051d9ecaadb5e66",
    7: "caa4ecbb01faece04022ce4221986c54c3a1c6e529f00554a37afd98e84d1128",
    8: "6c490bff05adf5b3f99561dc528303f2b4fcde8d72c9f1da4b3612dcc88d8e53",
    10: "47550bbb402741125164e2a055dfe87b856b50a2837045ecdd3efdd92c55628b",
    11: "a1db14d312242030f75ebb2f2ba98fbec2c75b0102b1f56c1387dab5b94c39b9",
    12: "0fb60a1890f7696b0c077f4b134b9b89786cb54f31dbdae4d0a375db23f0d705",
    13: "222c66fbd07aced8d2bba14f74889e563fc86f7ebe17375c5621d3ba0d97c917",
    14: "583e2f6fa31c7fece90f1322f85e15a49dde5b2ee210d24ff967d3ea4e339874",
    15: "c81266cb6a599066825f40728cfc2ea4479913db0d114bf04f6e14e7612825fc",
    16: "84068d68faae06324b11a5ea1274b4a3fc9ed52a62d5b340fa530ddded6b679e",
    17: "5827733a9977e629210bb766724aff4834127aee2aa7d09e9dd9e2519789c3c5",
    18: "d6f700b73f5daad53c6df40a0215e526a2d5b3ad97f0a35ad12fca95fdb20754",
    19: "64fe5e23ee9f70eb9c4c4d2c7077840d15c8a89459818ee7f8c2d6a7a5f82750",
    20: "37338aa1036048ffb19b2f76bdf44f98e3da581842866b4e6dae15440d89ba7e",
    21: "98484256165c8f771dcf697b588aed76ecc1ea61d166d5e53310ba2096471fd2",
}


class SchemaMigrationError(RuntimeError):
    """A schema migration cannot be applied, or the recorded history disagrees with the files."""


class _SqlFile:
    sql: str

    @property
    def checksum(self) -> str:
        """What the bookkeeping records of the file: SHA-256 of its text."""
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SchemaMigration(_SqlFile):
    """A numbered file: applied once, frozen after."""

    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclass(frozen=True)
class SchemaFunctions(_SqlFile):
    """A family's function file: the current definitions, applied again whenever they change."""

    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"functions/{self.name}"


def available_schema_functions() -> list[SchemaFunctions]:
    """The function files shipped in the package, by name (the order they are applied in)."""
    found = []
    for entry in _MIGRATIONS.joinpath("functions").iterdir():
        match = _FUNCTIONS_FILE_NAME.fullmatch(entry.name)
        if match:
            found.append(SchemaFunctions(match[1], entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda family: family.name)


def available_schema_migrations() -> list[SchemaMigration]:
    """The numbered files shipped in the package, in version order."""
    found = []
    for entry in _MIGRATIONS.iterdir():
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
-- Every application of a function file, so a tokensvc older than the database's functions is
-- told so instead of putting older bodies back.
CREATE TABLE IF NOT EXISTS tokensvc.schema_functions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
-- Created after 0001 on a database migrated before the function files: the schema's default
-- privileges would let the serving role write it.
REVOKE ALL ON tokensvc.schema_functions FROM {app_role};
"""


async def apply_schema_migrations(
    conn: asyncpg.Connection, *, app_role: str, runner_role: str = "tokensvc_runner"
) -> list[SchemaMigration | SchemaFunctions]:
    """Apply every pending numbered file, then every function file that changed (all of them when
    a numbered file ran); returns those applied (empty when up to date).

    `{app_role}` in a file is the serving group role, `{runner_role}` the re-embedding runner's
    (0021 on), both checked to be plain identifiers first."""
    for what, role in (("app", app_role), ("runner", runner_role)):
        if not is_sql_identifier(role):
            raise SchemaMigrationError(f"{what} role {role!r} is not a plain SQL identifier")

    def with_roles(sql: str) -> str:
        return sql.replace("{app_role}", app_role).replace("{runner_role}", runner_role)

    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        # Every file names its objects with their schema. Without tokensvc on the path, Citus
        # (which deparses a function's argument types relative to it before sending the function
        # to the workers) sends `tokensvc.embedding_migrations`, not a name the workers cannot find.
        await conn.execute("SELECT set_config('search_path', 'public', true)")
        await _check_pgvector(conn)
        await conn.execute(with_roles(_BOOKKEEPING))
        migrated = await _apply_numbered(conn, with_roles)
        functions = await _apply_functions(conn, with_roles, everything=bool(migrated))
    return [*migrated, *functions]


async def _apply_numbered(
    conn: asyncpg.Connection, with_roles: Callable[[str], str]
) -> list[SchemaMigration]:
    migrations = available_schema_migrations()
    recorded = {
        row["version"]: row["checksum"]
        for row in await conn.fetch("SELECT version, checksum FROM tokensvc.schema_migrations")
    }
    unknown = sorted(set(recorded) - {m.version for m in migrations})
    if unknown:
        raise SchemaMigrationError(
            f"the database has migrations {unknown} this tokensvc does not know; upgrade tokensvc"
        )
    applied = []
    for migration in migrations:
        if migration.version in recorded:
            if recorded[migration.version] == migration.checksum:
                continue
            if recorded[migration.version] != LEGACY_CHECKSUMS.get(migration.version):
                raise SchemaMigrationError(
                    f"migration {migration.label} was changed after it was applied; "
                    "add a new migration instead"
                )
            await conn.execute(
                "UPDATE tokensvc.schema_migrations SET checksum = $2 WHERE version = $1",
                migration.version,
                migration.checksum,
            )
            continue
        # A version whose functions moved to functions/ keeps only a comment, which the server
        # answers with an empty response that asyncpg cannot take.
        if not _ONLY_COMMENTS.fullmatch(migration.sql):
            await conn.execute(with_roles(migration.sql))
        await conn.execute(
            "INSERT INTO tokensvc.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            migration.version,
            migration.name,
            migration.checksum,
        )
        applied.append(migration)
    return applied


async def _apply_functions(
    conn: asyncpg.Connection, with_roles: Callable[[str], str], *, everything: bool
) -> list[SchemaFunctions]:
    current: dict[str, str] = {}
    earlier: dict[str, set[str]] = {}
    for row in await conn.fetch("SELECT name, checksum FROM tokensvc.schema_functions ORDER BY id"):
        if row["name"] in current:
            earlier.setdefault(row["name"], set()).add(current[row["name"]])
        current[row["name"]] = row["checksum"]
    # Citus asks for this opt-in before a trigger is created on a distributed table (a family
    # file's trigger, created anew after a numbered migration dropped it).
    await conn.execute(
        "SELECT set_config('citus.enable_unsafe_triggers', 'on', true) FROM pg_extension WHERE extname = 'citus'"
    )
    applied = []
    for family in available_schema_functions():
        if current.get(family.name) == family.checksum and not everything:
            continue
        if family.checksum in earlier.get(family.name, set()) - {current.get(family.name)}:
            raise SchemaMigrationError(
                f"functions/{family.name}.sql in the database is newer than this tokensvc's; upgrade tokensvc"
            )
        await conn.execute(with_roles(family.sql))
        await conn.execute(
            "INSERT INTO tokensvc.schema_functions (name, checksum) VALUES ($1, $2)",
            family.name,
            family.checksum,
        )
        applied.append(family)
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
