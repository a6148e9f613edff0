"""The re-embedding runner's credential is rotated like the serving one (issue 35): ROTATE and
RELOAD with `credential = RUNNER`, on its own login roles and its own line of versions, while a
migration runs; a crash mid-rotation is recovered by the runner's custodian.

Every test runs on this module's own embedded PostgreSQL: rotation changes the runner's login
roles' passwords and its secret files, which the session's shared database must keep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from tests.api.conftest import SETTINGS
from tests.api.memory_support import Launchers
from tests.api.test_embedding_migration import wait_for
from tests.credentials.rotation_support import (
    RELOAD,
    ROTATE,
    Admin,
    failure,
    has_password,
    journal_rows,
    last_id,
    login_error,
    private_database,
)
from tests.support import SharedDatabase, connect_as, role_channel, service_settings, superuser
from tokensvc.app import Service
from tokensvc.auth.devpki import ADMIN_SPIFFE_ID, DevPaths
from tokensvc.credentials import DatabaseCredential, FileCredentialSource, generate_password
from tokensvc.storage.postgres.scram import scram_sha256_verifier
from tokensvc.v1 import admin_pb2, migration_pb2, migration_pb2_grpc

RUNNER = admin_pb2.DATABASE_CREDENTIAL_RUNNER
RUNNER_ROLES = ("tokensvc_runner_a", "tokensvc_runner_b")
EMBEDDERS = (
    '[embedders.hash64]\nkind = "hash"\ndimension = 64\n\n[embedders.hash32]\nkind = "hash"\ndimension = 32\n'
)


@pytest.fixture(scope="module")
async def own(dev: DevPaths) -> AsyncIterator[SharedDatabase]:
    async with private_database(dev) as database:
        yield database


@pytest.fixture
async def start(
    own: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Service]]]:
    services: list[Service] = []
    embedders = tmp_path / "embedders.toml"
    embedders.write_text(EMBEDDERS, encoding="utf-8")

    async def start(**overrides: Any) -> Service:
        settings = {**SETTINGS, "embedders_file": embedders, "migration_batch_size": 4, **overrides}
        service = Service(service_settings(own, dev, tmp_path / f"state{len(services)}", **settings))
        services.append(service)
        await service.start()
        return service

    yield start
    for service in services:
        await service.stop(0)


@pytest.fixture
async def admin(
    start: Callable[..., Awaitable[Service]], dev: DevPaths
) -> AsyncIterator[tuple[Service, Admin]]:
    service = await start()
    client = Admin(service.port, dev)
    yield service, client
    await client.aclose()


def runner_source(database: SharedDatabase) -> FileCredentialSource:
    return FileCredentialSource(database.runner_credential_dir)


def other(role: str) -> str:
    return RUNNER_ROLES[1] if role == RUNNER_ROLES[0] else RUNNER_ROLES[0]


async def runner_login(service: Service) -> str:
    """The role a new connection of the service's runner pool logs in as."""
    assert service.database is not None
    assert service.database.runner_pool is not None
    async with service.database.runner_pool.acquire() as conn:
        return str(await conn.fetchval("SELECT session_user"))


async def test_rotate_moves_the_runner_to_its_other_role_and_a_migration_started_before_finishes(
    admin: tuple[Service, Admin], own: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    service, client = admin
    source = runner_source(own)
    before = source.read()
    statuses = await client.stub.GetCredentialStatus(admin_pb2.GetCredentialStatusRequest(), timeout=30)
    assert statuses.runner_status.credential == RUNNER
    assert statuses.runner_status.active_role == before.username
    serving_before = statuses.status
    assert serving_before.credential == admin_pb2.DATABASE_CREDENTIAL_SERVING
    journal_start = await last_id(own, "credential_rotations")

    # A migration of many small batches, so the rotation lands while the runner works.
    launchers = Launchers(service, dev, tmp_path / "launchers")
    channel = role_channel(service.port, dev, "control-plane")
    migrations = migration_pb2_grpc.MigrationServiceStub(channel)
    try:
        agent = launchers.new_agent()
        caller = launchers.caller(agent)
        remembered = await caller.remember(*(f"note {i} about the harbour" for i in range(90)))
        started = await migrations.StartEmbeddingMigration(
            migration_pb2.StartEmbeddingMigrationRequest(
                memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent=agent),
                embedder="hash32",
            ),
            timeout=30,
        )
        response = await client.stub.RotateDatabaseCredentials(
            admin_pb2.RotateDatabaseCredentialsRequest(mode=ROTATE, credential=RUNNER), timeout=30
        )
        finished = await wait_for(migrations, started.migration.id, migration_pb2.MIGRATION_PHASE_SUCCEEDED)
        found = await caller.search("note about the harbour", top_k=100)
    finally:
        await launchers.aclose()
        await channel.close(grace=None)

    rotated = response.status
    new = source.read()
    assert rotated.credential == RUNNER
    assert rotated.active_role == new.username == other(before.username)
    assert rotated.credential_version == statuses.runner_status.credential_version + 1
    assert (rotated.last_rotation_mode, rotated.last_rotation_outcome) == (
        admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE,
        admin_pb2.ROTATION_OUTCOME_SUCCEEDED,
    )
    # The runner's old login is retired; its pool serves on the new one; serving is untouched.
    assert await login_error(own, before) is asyncpg.InvalidPasswordError
    assert not await has_password(own, before.username)
    assert await runner_login(service) == new.username
    after = await client.status()
    assert (after.active_role, after.credential_version) == (
        serving_before.active_role,
        serving_before.credential_version,
    )
    # The migration finished on the rotated credential and lost nothing.
    assert finished.rows_done == finished.rows_total >= 90
    assert set(remembered) <= {r.memory.id for r in found}
    rows = await journal_rows(own, journal_start)
    assert [(r["credential"], r["mode"], r["to_role"], r["outcome"]) for r in rows] == [
        ("runner", "rotate", new.username, "succeeded")
    ]
    (event, *_) = await client.events(admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_ROTATION)
    assert (event.actor, event.action, event.target, event.outcome) == (
        ADMIN_SPIFFE_ID,
        "rotate runner database credential",
        new.username,
        admin_pb2.AUDIT_OUTCOME_SUCCEEDED,
    )


async def test_an_external_rotator_changing_the_runner_secret_is_reloaded_by_itself(
    admin: tuple[Service, Admin], own: SharedDatabase
) -> None:
    service, client = admin
    source = runner_source(own)
    active = source.read()
    serving = await client.status()
    new = DatabaseCredential(other(active.username), generate_password())
    async with connect_as(own.rotator_credential_dir, own.dsn) as conn:
        await conn.execute(f"ALTER ROLE {new.username} PASSWORD '{scram_sha256_verifier(new.password)}'")
    source.write(new)

    changed_at = time.monotonic()
    while True:
        statuses = await client.stub.GetCredentialStatus(admin_pb2.GetCredentialStatusRequest(), timeout=30)
        runner = statuses.runner_status
        if (runner.active_role, runner.last_rotation_outcome) == (
            new.username,
            admin_pb2.ROTATION_OUTCOME_SUCCEEDED,
        ):
            break
        assert time.monotonic() - changed_at < 10, "the watcher did not reload the runner within 10 s"
        await asyncio.sleep(0.1)
    assert runner.last_rotation_mode == admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD
    assert await runner_login(service) == new.username
    # The serving credential's line is another: its role and version did not move.
    assert (statuses.status.active_role, statuses.status.credential_version) == (
        serving.active_role,
        serving.credential_version,
    )


async def test_a_runner_reload_to_a_password_that_does_not_log_in_keeps_the_old_one(
    admin: tuple[Service, Admin], own: SharedDatabase
) -> None:
    service, client = admin
    source = runner_source(own)
    active = source.read()
    source.write(DatabaseCredential(other(active.username), "not the password"))
    try:
        refused = None
        for _ in range(100):  # the file watcher may hold the rotation lock for a moment
            refused = await failure(
                client.stub.RotateDatabaseCredentials(
                    admin_pb2.RotateDatabaseCredentialsRequest(mode=RELOAD, credential=RUNNER), timeout=30
                )
            )
            if refused.reason != "ROTATION_IN_PROGRESS":
                break
            await asyncio.sleep(0.05)
        assert refused is not None
        assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CREDENTIAL_INVALID")
        assert service.database is not None
        assert service.database.runner_pool is not None
        await service.database.runner_pool.expire_connections()
        assert await runner_login(service) == active.username
    finally:
        source.write(active)


async def test_rotating_the_runner_on_a_replica_without_its_credential_is_refused_with_the_field(
    start: Callable[..., Awaitable[Service]], dev: DevPaths
) -> None:
    service = await start(database_runner_credential_dir=None)
    client = Admin(service.port, dev)
    try:
        statuses = await client.stub.GetCredentialStatus(admin_pb2.GetCredentialStatusRequest(), timeout=30)
        refused = await failure(
            client.stub.RotateDatabaseCredentials(
                admin_pb2.RotateDatabaseCredentialsRequest(mode=ROTATE, credential=RUNNER), timeout=30
            )
        )
    finally:
        await client.aclose()
    assert (refused.code, refused.reason, refused.metadata.get("field")) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "ROTATION_FAILED",
        "credential",
    )
    assert not statuses.HasField("runner_status")


async def test_a_runner_rotation_a_crash_interrupted_is_recovered_by_the_runner_alone(
    start: Callable[..., Awaitable[Service]], own: SharedDatabase, dev: DevPaths
) -> None:
    active = runner_source(own).read()
    half_set = other(active.username)
    async with superuser(own) as conn:
        # What a crash after `set_password` leaves: an open runner row, the inactive role with a
        # password nobody holds, the secret source still naming the old role.
        await conn.execute(f"ALTER ROLE {half_set} PASSWORD 'left by the crash'")
        rotation = await conn.fetchval(
            "INSERT INTO credential_rotations (credential, mode, actor, from_role, to_role, step, outcome) "
            "VALUES ('runner', 'rotate', 'crashed', $1, $2, 'test_login', 'in_progress') RETURNING id",
            active.username,
            half_set,
        )
        serving_version = await conn.fetchval(
            "SELECT coalesce(max(version), 0) FROM credential_rotations WHERE credential = 'serving'"
        )
    service = await start()
    async with superuser(own) as conn:
        row = await conn.fetchrow("SELECT * FROM credential_rotations WHERE id = $1", rotation)
        after = await conn.fetchval(
            "SELECT coalesce(max(version), 0) FROM credential_rotations WHERE credential = 'serving'"
        )
    assert (row["outcome"], row["reason"]) == ("recovered", f"rolled back to {active.username}")
    assert not await has_password(own, half_set)
    assert await runner_login(service) == active.username
    assert after == serving_version  # the serving credential's line saw nothing of it
