"""Session fixtures: one real embedded PostgreSQL, the dev PKI, and tokensvc servers over mTLS."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.api.memory_support import Launchers
from tests.support import SharedDatabase, service_settings
from tokensvc.app import Service, locate_database, migrate
from tokensvc.auth.devpki import DevPaths, ensure_dev_material
from tokensvc.storage.postgres import EmbeddedPostgres


@pytest.fixture(scope="session")
def dev(tmp_path_factory: pytest.TempPathFactory) -> DevPaths:
    return ensure_dev_material(tmp_path_factory.mktemp("dev-state"))


@pytest.fixture(scope="session")
async def database(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedDatabase]:
    """A real PostgreSQL 18 + pgvector for the whole session, migrated once.

    Its directory is not under pytest's basetemp: another pytest session starting on the same
    machine resets that tree to mode 0700, which would lock out PostgreSQL's unprivileged user.
    """
    state = Path(tempfile.mkdtemp(prefix="tokensvc-test-pg-"))
    server = EmbeddedPostgres(state)
    await server.start()
    shared = SharedDatabase(server)
    settings = service_settings(shared, ensure_dev_material(tmp_path_factory.mktemp("mig")), Path("."))
    located = await locate_database(settings)
    await migrate(located, settings)
    yield shared
    await server.stop()
    shutil.rmtree(state, ignore_errors=True)


ServiceFactory = Callable[..., Awaitable[Service]]


@pytest.fixture
async def start_service(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[ServiceFactory]:
    """Start tokensvc servers in-process on the shared database; all are stopped afterwards."""
    started: list[Service] = []

    async def start(**overrides: Any) -> Service:
        service = Service(service_settings(database, dev, tmp_path, **overrides))
        started.append(service)
        await service.start()
        return service

    yield start
    for service in started:
        await service.stop(grace=0)


@pytest.fixture
async def service(start_service: ServiceFactory) -> Service:
    return await start_service()


@pytest.fixture
async def launchers(service: Service, dev: DevPaths, tmp_path: Path) -> AsyncIterator[Launchers]:
    """Launchers for fresh agents against the test's service; channels closed afterwards."""
    pool = Launchers(service, dev, tmp_path / "launchers")
    yield pool
    await pool.aclose()


@pytest.fixture
async def launchers_on(
    start_service: Any, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Launchers]]]:
    """Launchers for a service started with the given setting overrides."""
    pools: list[Launchers] = []

    async def start(**settings: Any) -> Launchers:
        pools.append(Launchers(await start_service(**settings), dev, tmp_path / f"launchers{len(pools)}"))
        return pools[-1]

    yield start
    for pool in pools:
        await pool.aclose()
