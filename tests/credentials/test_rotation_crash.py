"""SIGKILL between every pair of ROTATE steps, then restart: back on exactly one working credential.

ROTATE journals each step before taking it: set_password, test_login, write_secret, switch,
retire_old, then completes. A tokensvc subprocess (`crash_server.py`) kills itself as the journal
is about to record one step; a normal tokensvc restarted on the same database and secret
directories must recover: roll back while the secret source still holds the old credential (the
new role's half-set password is removed), roll forward once it holds the new one (the old role's
password is removed). Each case gets a fresh embedded PostgreSQL, so no case depends on another.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import asyncpg
import grpc
import pytest

from tests.api.memory_support import Launchers
from tests.credentials.rotation_support import (
    ROTATE,
    Admin,
    failure,
    has_password,
    journal_rows,
    login_error,
    other_role,
    private_database,
    settings_json,
    wait_until_serving,
)
from tests.support import SharedDatabase, free_port, service_settings, superuser
from tokensvc.app import Service
from tokensvc.audit import SYSTEM_ACTOR
from tokensvc.auth.devpki import ADMIN_SPIFFE_ID, DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres.logins import ROTATION_LOCK
from tokensvc.v1 import admin_pb2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# (the step the journal was about to record when the process died, the step it last recorded,
#  which way recovery must go)
CASES = [
    ("set_password", "started", "back"),
    ("test_login", "set_password", "back"),
    ("write_secret", "test_login", "back"),
    ("switch", "write_secret", "forward"),
    ("retire_old", "switch", "forward"),
    ("completed", "retire_old", "forward"),
]


async def wait_for_rotation_lock_release(database: SharedDatabase, within: float = 10) -> None:
    """Until the dead process's database session (holding the rotation lock) has ended."""
    deadline = time.monotonic() + within
    async with superuser(database) as conn:
        while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", ROTATION_LOCK):
            assert time.monotonic() < deadline, "the killed process's session kept the rotation lock"
            await asyncio.sleep(0.05)
        await conn.fetchval("SELECT pg_advisory_unlock($1)", ROTATION_LOCK)


async def assert_exactly_one_login(database: SharedDatabase, recorded_role: str) -> None:
    """The secret source's credential logs in; the other login role has no password at all."""
    recorded = FileCredentialSource(database.app_credential_dir).read()
    assert recorded.username == recorded_role
    assert await login_error(database, recorded) is None
    assert not await has_password(database, other_role(recorded_role))


@pytest.mark.parametrize(
    ("crash_at", "last_recorded", "direction"), CASES, ids=[f"before_{case[0]}" for case in CASES]
)
async def test_sigkill_mid_rotation_restarts_serving_on_exactly_one_recorded_credential(
    crash_at: str, last_recorded: str, direction: str, dev: DevPaths, tmp_path: Path
) -> None:
    async with private_database(dev) as database:
        await crash_then_restart(database, crash_at, last_recorded, direction, dev, tmp_path)


async def crash_then_restart(
    database: SharedDatabase, crash_at: str, last_recorded: str, direction: str, dev: DevPaths, tmp_path: Path
) -> None:
    process: asyncio.subprocess.Process | None = None
    service: Service | None = None
    try:
        source = FileCredentialSource(database.app_credential_dir)
        before = source.read()
        target_role = other_role(before.username)

        # 1. A tokensvc that dies as the journal is about to record `crash_at`.
        port = free_port()
        config = settings_json(
            service_settings(database, dev, tmp_path / "crashing", listen_address=f"127.0.0.1:{port}"),
            tmp_path / "settings.json",
        )
        env = {key: value for key, value in os.environ.items() if not key.startswith("TOKENSVC_")}
        with (tmp_path / "crash_server.log").open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.credentials.crash_server",
                str(config),
                cwd=ROOT,
                env={**env, "CRASH_AT_STEP": crash_at},
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        running = process
        await wait_until_serving(port, dev, alive=lambda: running.returncode is None)
        admin = Admin(port, dev)
        try:
            died = await failure(admin.rotate(ROTATE))
        finally:
            await admin.aclose()
        assert died.code == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGKILL
        assert f"before journal step {crash_at}" in (tmp_path / "crash_server.log").read_text()

        (interrupted,) = await journal_rows(database)
        assert (interrupted["outcome"], interrupted["step"]) == ("in_progress", last_recorded)
        assert (interrupted["from_role"], interrupted["to_role"]) == (before.username, target_role)

        # 2. Restart a normal tokensvc on the same database and secret directories.
        await wait_for_rotation_lock_release(database)
        service = Service(service_settings(database, dev, tmp_path / "restarted"))
        await service.start()
        await wait_until_serving(service.port, dev)

        recorded_role = target_role if direction == "forward" else before.username
        await assert_exactly_one_login(database, recorded_role)
        if direction == "forward":
            assert await login_error(database, before) is asyncpg.InvalidPasswordError
        else:
            assert source.read() == before

        (recovered,) = await journal_rows(database)
        assert recovered["id"] == interrupted["id"]
        assert recovered["outcome"] == "recovered"
        assert recovered["step"] == last_recorded
        word = "forward" if direction == "forward" else "back"
        assert recovered["reason"] == f"rolled {word} to {recorded_role}"
        assert recovered["version"] == (1 if direction == "forward" else None)

        admin = Admin(service.port, dev)
        launchers = Launchers(service, dev, tmp_path / "launchers")
        try:
            status = await admin.status()
            assert status.active_role == recorded_role
            assert status.last_rotation_outcome == admin_pb2.ROTATION_OUTCOME_RECOVERED
            assert status.credential_version == (1 if direction == "forward" else 0)
            events = await admin.events(admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_ROTATION)
            assert [(e.actor, e.outcome) for e in reversed(events)] == [
                (ADMIN_SPIFFE_ID, admin_pb2.AUDIT_OUTCOME_STARTED),
                (SYSTEM_ACTOR, admin_pb2.AUDIT_OUTCOME_SUCCEEDED),
            ]
            assert events[0].detail.endswith(f"interrupted at step {last_recorded}; {word}")

            # Serving: a Remember and a search find it, over fresh pool connections.
            assert service.database is not None
            await service.database.pool.expire_connections()
            caller = launchers.caller()
            (memory_id,) = await caller.remember("written after the crash")
            assert memory_id in [r.memory.id for r in await caller.search("written after the crash")]

            # And the next rotation starts from a consistent state.
            rotated = await admin.rotate(ROTATE)
            assert rotated.active_role == other_role(recorded_role)
            await assert_exactly_one_login(database, rotated.active_role)
            (memory_id,) = await caller.remember("written after the next rotation")
            assert memory_id in [r.memory.id for r in await caller.search("after the next rotation")]
        finally:
            await launchers.aclose()
            await admin.aclose()
    finally:
        if service is not None:
            await service.stop(0)
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()
