"""What the migration tests share: connections to a scratch database (the `scratch` fixture, in
tests/storage/conftest.py), migrated up to a version."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from tests.support import SharedDatabase
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres import apply_schema_migrations, available_schema_migrations
from tokensvc.storage.postgres import schema_migrations as migration_module

APP_ROLE = "tokensvc_app"


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
    """Apply migrations 1..`version` only, as a database created before the later ones would be."""
    assert len(await migrate_through(conn, version, monkeypatch)) == version


async def migrate_through(
    conn: asyncpg.Connection, version: int, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """Apply the pending migrations up to `version` (none later); returns those applied."""
    before = [m for m in available_schema_migrations() if m.version <= version]
    with monkeypatch.context() as patched:
        patched.setattr(migration_module, "available_schema_migrations", lambda: before)
        return list(await apply_schema_migrations(conn, app_role=APP_ROLE))
