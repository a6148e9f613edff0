"""Fixtures shared by the MemoryService end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.api.memory_support import Launchers
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths


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
