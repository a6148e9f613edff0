"""Fixtures of the re-embedding migration tests (memory spaces and knowledge bases)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.api.memory_support import TIMEOUT, Launchers
from tests.support import role_channel
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import migration_pb2, migration_pb2_grpc

SETTINGS = {
    "memory_embedder": "hash64",
    "memory_space_cache_seconds": 0.2,
    "migration_retire_seconds": 1.0,
    "migration_lease_seconds": 5.0,
}


@pytest.fixture
def embedders_file(tmp_path: Path) -> Path:
    config = tmp_path / "embedders.toml"
    config.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
    return config


@pytest.fixture
async def migrating(
    start_service: Any, embedders_file: Path, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[Any]:
    service: Service = await start_service(embedders_file=embedders_file, **SETTINGS)
    launchers = Launchers(service, dev, tmp_path / "launchers")
    channel = role_channel(service.port, dev, "control-plane")
    stub = migration_pb2_grpc.MigrationServiceStub(channel)
    try:
        yield service, launchers, stub
    finally:
        await _cancel_unfinished(stub)
        await launchers.aclose()
        await channel.close(grace=None)


async def _cancel_unfinished(stub: migration_pb2_grpc.MigrationServiceStub) -> None:
    """A test that failed mid-way leaves its migration backfilling in the shared database, where
    the next tests' runners would spend their time on it (on Citus, minutes): cancel it."""
    listed = await stub.ListEmbeddingMigrations(
        migration_pb2.ListEmbeddingMigrationsRequest(page_size=100), timeout=TIMEOUT
    )
    for migration in listed.migrations:
        if migration.phase in (
            migration_pb2.MIGRATION_PHASE_BACKFILLING,
            migration_pb2.MIGRATION_PHASE_PAUSED,
        ):
            with contextlib.suppress(grpc.aio.AioRpcError):  # it finished or was cancelled meanwhile
                await stub.CancelEmbeddingMigration(
                    migration_pb2.CancelEmbeddingMigrationRequest(id=migration.id), timeout=TIMEOUT
                )
