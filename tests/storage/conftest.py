"""Fixtures of the storage tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from tests.storage.migration_support import scratch_database
from tests.support import SharedDatabase, service_settings
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths


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
    async with scratch_database(database) as name:
        yield name
