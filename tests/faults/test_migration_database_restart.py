"""A re-embedding migration across a database crash: the embedded PostgreSQL SIGKILLed mid-way.

The service restarts its PostgreSQL by itself; the migration resumes from its last committed
batch (its cursor and progress are rows of the database) and completes exactly once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest

from tests.api.memory_support import TIMEOUT, Launchers
from tests.faults.harness import (
    embedded_settings,
    new_state_dir,
    postmaster_pid,
    stop_postmaster,
    superuser,
)
from tests.support import role_channel
from tokensvc.app import Service
from tokensvc.auth.devpki import ensure_dev_material
from tokensvc.v1 import migration_pb2, migration_pb2_grpc

pytestmark = pytest.mark.slow

USERS = 2
ROWS_PER_USER = 60


async def migration_state(state: object, migration_id: str) -> tuple[str, int] | None:
    """(state, rows done), None while the database is down."""
    try:
        async with superuser(state) as conn:  # type: ignore[arg-type]
            row = await conn.fetchrow(
                "SELECT state, rows_done FROM tokensvc.embedding_migrations WHERE id = $1", migration_id
            )
    except Exception:  # down or starting: try again
        return None
    return None if row is None else (row["state"], row["rows_done"])


async def test_a_migration_resumes_after_its_database_is_killed_and_completes_exactly_once() -> None:
    state = new_state_dir("migration-restart")
    dev = ensure_dev_material(state)
    embedders = state / "embedders.toml"
    embedders.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
    settings = embedded_settings(
        state,
        dev,
        embedders_file=str(embedders),
        memory_embedder="hash64",
        migration_batch_size=4,
        migration_lease_seconds=2.0,
        migration_retire_seconds=1.0,
        memory_space_cache_seconds=0.2,
        health_check_interval_seconds=0.2,
        database_connect_timeout_seconds=2.0,
    )
    service = Service(settings)
    try:
        await service.start()
        launchers = Launchers(service, dev, state / "launchers")
        agent = launchers.new_agent()
        for u in range(USERS):
            caller = launchers.caller(agent, user=f"user-{u}", per_user=True)
            await caller.remember(*(f"user {u} remembers fact number {i}" for i in range(ROWS_PER_USER)))
        control = role_channel(service.port, dev, "control-plane")
        started = await migration_pb2_grpc.MigrationServiceStub(control).StartEmbeddingMigration(
            migration_pb2.StartEmbeddingMigrationRequest(
                memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent=agent),
                embedder="multilingual-e5-small",
            ),
            timeout=TIMEOUT,
        )
        migration_id = started.migration.id
        await control.close(grace=None)

        began = time.monotonic()
        while time.monotonic() - began < 120:
            now = await migration_state(state, migration_id)
            if now is not None and now[1] >= ROWS_PER_USER // 2:
                break
            await asyncio.sleep(0.02)
        assert now is not None
        assert now[0] == "backfilling"
        assert 0 < now[1] < USERS * ROWS_PER_USER
        pid = postmaster_pid(state)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

        began = time.monotonic()
        while time.monotonic() - began < 180:
            now = await migration_state(state, migration_id)
            if now is not None and now[0] == "succeeded":
                break
            await asyncio.sleep(0.2)
        assert now == ("succeeded", USERS * ROWS_PER_USER)  # every memory embedded once
        async with superuser(state) as conn:
            rows = await conn.fetchrow(
                "SELECT count(*) AS n, count(embedding) AS old, count(*) FILTER (WHERE dimension_b = 384) AS new "
                "FROM tokensvc.memories WHERE agent = $1",
                agent,
            )
            generation = await conn.fetchval(
                "SELECT generation FROM tokensvc.memory_spaces WHERE agent = $1", agent
            )
        assert tuple(rows) == (USERS * ROWS_PER_USER, 0, USERS * ROWS_PER_USER)
        assert generation == 1
        found = await launchers.caller(agent, user="user-0", per_user=True).search(
            "user 0 remembers fact number 9", top_k=1
        )
        assert found[0].memory.content == "user 0 remembers fact number 9"
        await launchers.aclose()
    finally:
        await service.stop(grace=0)
        await stop_postmaster(state)
        shutil.rmtree(state, ignore_errors=True)
