"""Fixtures of the storage tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tests.storage.migration_support import connect
from tests.support import SharedDatabase, service_settings
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import FileCredentialSource


@pytest.fixture
async def pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    """The serving role's pool, opened as the service opens it (modules that share one across
    their tests keep their own, module-scoped)."""
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("pool")))
    try:
        yield await db.open_pool()
    finally:
        await db.close()


@pytest.fixture
async def runner_pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    """The re-embedding runner role's pool, opened as the service opens it."""
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("runner-pool")))
    try:
        await db.open_pool()
        source = db.target.runner_credentials
        assert source is not None
        yield await db.open_runner_pool(source.read, 4)
    finally:
        await db.close()


@pytest.fixture
async def scratch(database: SharedDatabase) -> AsyncIterator[str]:
    """A database of its own on the shared server, owned by the schema owner, with pgvector."""
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
