"""What the migration tests share: connections to a scratch database (the `scratch` fixture, in
tests/storage/conftest.py), migrated up to a version."""

from __future__ import annotations

import hashlib
import io
import tarfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support import SharedDatabase
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres import apply_schema_migrations, available_schema_migrations
from tokensvc.storage.postgres import schema_migrations as migration_module
from tokensvc.storage.postgres.schema_migrations import LOCK_ID

APP_ROLE = "tokensvc_app"
RUNNER_ROLE = "tokensvc_runner"
BEFORE_THE_SWITCH = Path(__file__).parent / "fixtures" / "migrations_before_functions.tar.gz"
BOOKKEEPING_BEFORE_THE_SWITCH = """
CREATE SCHEMA IF NOT EXISTS tokensvc;
CREATE TABLE IF NOT EXISTS tokensvc.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


async def connect(database: SharedDatabase, who: str, name: str) -> asyncpg.Connection:
    """Database `name` as `who`: the superuser, the schema owner, or the serving role's login."""
    directory = {
        "superuser": database.superuser_credential_dir,
        "owner": database.owner_credential_dir,
        "app": database.app_credential_dir,
    }[who]
    credential = FileCredentialSource(directory).read()
    dsn = database.dsn.rsplit("/", 1)[0] + f"/{name}"
    return await asyncpg.connect(dsn, user=credential.username, password=credential.password)


async def migrate_up_to(conn: asyncpg.Connection, version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Migrations 1..`version` only, as a database created before the later ones was: by the tree
    before the function files (no database at an older version was made any other way), its
    functions as they were then."""
    await migrate_with_the_tree_before_the_switch(conn, up_to=version)


async def migrate_through(
    conn: asyncpg.Connection, version: int, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """Apply today's pending numbered migrations up to `version` (none later), and the function
    files only when that is the newest (they define today's functions, over today's tables);
    returns those applied."""
    shipped = available_schema_migrations()
    before = [m for m in shipped if m.version <= version]
    with monkeypatch.context() as patched:
        patched.setattr(migration_module, "available_schema_migrations", lambda: before)
        if version < shipped[-1].version:
            patched.setattr(migration_module, "available_schema_functions", lambda: [])
        return list(await apply_schema_migrations(conn, app_role=APP_ROLE))


def before_the_switch() -> Iterator[tuple[int, str]]:
    """The numbered files as they were before their functions moved to functions/: (version, SQL)."""
    with tarfile.open(BEFORE_THE_SWITCH) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            handle = archive.extractfile(member)
            assert handle is not None
            yield int(member.name[:4]), io.TextIOWrapper(handle, encoding="utf-8").read()


async def migrate_with_the_tree_before_the_switch(conn: asyncpg.Connection, up_to: int | None = None) -> None:
    """What `tokensvc migrate` did before the function files: each numbered file (up to `up_to`),
    recorded by checksum."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        await conn.execute(BOOKKEEPING_BEFORE_THE_SWITCH)
        for version, sql in before_the_switch():
            if up_to is not None and version > up_to:
                break
            await conn.execute(sql.replace("{app_role}", APP_ROLE).replace("{runner_role}", RUNNER_ROLE))
            await conn.execute(
                "INSERT INTO tokensvc.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                version,
                f"before the switch {version}",
                hashlib.sha256(sql.encode("utf-8")).hexdigest(),
            )


@asynccontextmanager
async def scratch_database(database: SharedDatabase) -> AsyncIterator[str]:
    """A database of its own on the shared server, owned by the schema owner, with pgvector;
    dropped on the way out."""
    name = f"mig_{uuid.uuid4().hex[:10]}"
    admin = await connect(database, "superuser", "postgres")
    owner = FileCredentialSource(database.owner_credential_dir).read().username
    await admin.execute(f"CREATE DATABASE {name} OWNER {owner}")
    conn = await connect(database, "superuser", name)
    await conn.execute("CREATE EXTENSION vector")
    await conn.close()
    try:
        yield name
    finally:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()
