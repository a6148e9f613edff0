"""Migrations: idempotent, serialised, and honest about drift."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests.support import SharedDatabase
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres import (
    SchemaMigrationError,
    apply_schema_migrations,
    available_schema_migrations,
    schema_version,
)

SCHEMA_SNAPSHOT = """
SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = 'tokensvc' ORDER BY 1, 3
"""


async def owner_connection(database: SharedDatabase) -> asyncpg.Connection:
    credential = FileCredentialSource(database.owner_credential_dir).read()
    return await asyncpg.connect(database.dsn, user=credential.username, password=credential.password)


async def test_running_migrations_again_changes_nothing(database: SharedDatabase) -> None:
    conn = await owner_connection(database)
    try:
        before = await conn.fetch(SCHEMA_SNAPSHOT)
        history = await conn.fetch("SELECT version, checksum, applied_at FROM tokensvc.schema_migrations")
        assert await apply_schema_migrations(conn, app_role="tokensvc_app") == []
        assert await apply_schema_migrations(conn, app_role="tokensvc_app") == []
        assert await conn.fetch(SCHEMA_SNAPSHOT) == before
        assert (
            await conn.fetch("SELECT version, checksum, applied_at FROM tokensvc.schema_migrations")
            == history
        )
        assert await schema_version(conn) == len(available_schema_migrations())
    finally:
        await conn.close()


async def test_concurrent_migrations_serialise_on_the_advisory_lock(database: SharedDatabase) -> None:
    connections = [await owner_connection(database) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(apply_schema_migrations(conn, app_role="tokensvc_app") for conn in connections)
        )
        assert results == [[], [], []]
    finally:
        for conn in connections:
            await conn.close()


async def test_an_applied_migration_that_changed_is_an_error(database: SharedDatabase) -> None:
    conn = await owner_connection(database)
    try:
        async with conn.transaction():
            await conn.execute("UPDATE tokensvc.schema_migrations SET checksum = 'edited' WHERE version = 1")
            with pytest.raises(SchemaMigrationError, match="changed after it was applied"):
                await apply_schema_migrations(conn, app_role="tokensvc_app")
            raise asyncpg.exceptions.RaiseError  # roll the edit back
    except asyncpg.exceptions.RaiseError:
        pass
    finally:
        await conn.close()


async def test_app_role_name_must_be_a_plain_identifier(database: SharedDatabase) -> None:
    conn = await owner_connection(database)
    try:
        with pytest.raises(SchemaMigrationError, match="identifier"):
            await apply_schema_migrations(conn, app_role="x; DROP SCHEMA tokensvc")
    finally:
        await conn.close()


async def test_the_serving_role_cannot_rewrite_the_migration_history(database: SharedDatabase) -> None:
    credential = FileCredentialSource(database.app_credential_dir).read()
    conn = await asyncpg.connect(database.dsn, user=credential.username, password=credential.password)
    try:
        assert await schema_version(conn) == len(available_schema_migrations())
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM tokensvc.schema_migrations")
    finally:
        await conn.close()
