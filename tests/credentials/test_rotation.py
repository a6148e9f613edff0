"""Database credential rotation while serving: ROTATE, RELOAD, the file watcher, and failures.

Every test here runs tokensvc on this module's own embedded PostgreSQL (rotation changes the
login roles' passwords and the app secret files, which the session's shared database must keep).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from tests.api.memory_support import Caller, Launchers
from tests.credentials.rotation_support import (
    RELOAD,
    ROTATE,
    Admin,
    Traffic,
    failure,
    has_password,
    journal_rows,
    last_id,
    login_error,
    other_role,
    private_database,
    rotator_set_password,
)
from tests.support import RpcFailure, SharedDatabase, failure_of, service_settings, superuser
from tokensvc.app import Service
from tokensvc.audit import SYSTEM_ACTOR
from tokensvc.auth.devpki import ADMIN_SPIFFE_ID, DevPaths
from tokensvc.credentials import DatabaseCredential, FileCredentialSource, generate_password
from tokensvc.v1 import admin_pb2, common_pb2

ROTATION_EVENTS = admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_ROTATION
RELOAD_EVENTS = admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_RELOAD
STARTED, SUCCEEDED, FAILED = (
    admin_pb2.AUDIT_OUTCOME_STARTED,
    admin_pb2.AUDIT_OUTCOME_SUCCEEDED,
    admin_pb2.AUDIT_OUTCOME_FAILED,
)
CLIENTS = 8
PLAN = (ROTATE, RELOAD, ROTATE, ROTATE, RELOAD, ROTATE, ROTATE)


@pytest.fixture(scope="module")
async def own(dev: DevPaths) -> AsyncIterator[SharedDatabase]:
    """This module's own PostgreSQL: rotations here never touch the session's database."""
    async with private_database(dev) as database:
        yield database


@pytest.fixture
async def start(
    own: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Service]]]:
    services: list[Service] = []

    async def start(**overrides: Any) -> Service:
        service = Service(service_settings(own, dev, tmp_path / f"state{len(services)}", **overrides))
        services.append(service)
        await service.start()
        return service

    yield start
    for service in services:
        await service.stop(0)


@pytest.fixture
async def running(start: Callable[..., Awaitable[Service]]) -> Service:
    return await start()


@pytest.fixture
async def admin(running: Service, dev: DevPaths) -> AsyncIterator[Admin]:
    client = Admin(running.port, dev)
    yield client
    await client.aclose()


@pytest.fixture
async def launchers(running: Service, dev: DevPaths, tmp_path: Path) -> AsyncIterator[Launchers]:
    pool = Launchers(running, dev, tmp_path / "launchers")
    yield pool
    await pool.aclose()


def app_source(database: SharedDatabase) -> FileCredentialSource:
    return FileCredentialSource(database.app_credential_dir)


async def serves(caller: Caller, word: str) -> None:
    """A Remember and a SearchMemories that must both work."""
    (memory_id,) = await caller.remember(f"still serving: {word}")
    assert memory_id in [r.memory.id for r in await caller.search(f"still serving: {word}", top_k=50)]


async def reload_rpc(admin: Admin) -> admin_pb2.CredentialStatus:
    """RELOAD, retried while the file watcher is itself reloading (ABORTED, ROTATION_IN_PROGRESS)."""
    for _ in range(100):
        try:
            return await admin.rotate(RELOAD)
        except grpc.aio.AioRpcError as exc:
            if failure_of(exc).reason != "ROTATION_IN_PROGRESS":
                raise
        await asyncio.sleep(0.05)
    raise AssertionError("the file watcher kept the rotation lock for 5 s")


async def failed_reload(admin: Admin) -> RpcFailure:
    for _ in range(100):
        caught = await failure(admin.rotate(RELOAD))
        if caught.reason != "ROTATION_IN_PROGRESS":
            return caught
        await asyncio.sleep(0.05)
    raise AssertionError("the file watcher kept the rotation lock for 5 s")


async def external_rotation(
    admin: Admin, database: SharedDatabase, current: DatabaseCredential
) -> DatabaseCredential:
    """What Vault or External Secrets do: a new password on the inactive role, then the file; RELOAD."""
    new = DatabaseCredential(other_role(current.username), generate_password())
    await rotator_set_password(database, new.username, new.password)
    app_source(database).write(new)
    # The file watcher may have reloaded first; then this RELOAD finds nothing to do.
    status = await reload_rpc(admin)
    assert status.active_role == new.username
    # The external rotator retires the previous login once tokensvc has moved off it.
    await rotator_set_password(database, current.username, None)
    return new


async def new_events(admin: Admin, after_id: int, *kinds: int) -> list[admin_pb2.AuditEvent]:
    return [event for event in await admin.events(*kinds) if int(event.id) > after_id]


async def admin_reload_outcomes(admin: Admin, after_id: int) -> list[tuple[int, int]]:
    """(outcome, reason) of the admin's RELOADs, less those refused because the watcher was busy."""
    return [
        (e.outcome, e.reason)
        for e in await new_events(admin, after_id, RELOAD_EVENTS)
        if e.actor == ADMIN_SPIFFE_ID and e.reason != common_pb2.ERROR_REASON_ROTATION_IN_PROGRESS
    ]


# --- Done when #1 ------------------------------------------------------------------------------


async def test_five_rotations_and_two_reloads_under_load_fail_no_rpc_and_lose_no_memory(
    running: Service, admin: Admin, launchers: Launchers, own: SharedDatabase
) -> None:
    source = app_source(own)
    used = [source.read()]
    before = await admin.status()
    journal_start = await last_id(own, "credential_rotations")
    audit_start = await last_id(own, "audit_events")
    callers = [launchers.caller(user=f"user-{i}", per_user=i % 2 == 0) for i in range(CLIENTS)]
    traffic = Traffic(callers)
    traffic.start()
    await traffic.wait_for(4 * CLIENTS)

    sent_before, started = traffic.sent, time.monotonic()
    durations: dict[str, list[float]] = {"rotate": [], "reload": []}
    try:
        for mode in PLAN:
            began = time.monotonic()
            if mode == ROTATE:
                status = await admin.rotate(ROTATE)
                new = source.read()
                assert status.active_role == new.username == other_role(used[-1].username)
                durations["rotate"].append(time.monotonic() - began)
            else:
                new = await external_rotation(admin, own, used[-1])
                durations["reload"].append(time.monotonic() - began)
            used.append(new)
            await traffic.wait_for(3 * CLIENTS)  # serve a while on the new credential
    finally:
        await traffic.stop()
    sent_during, elapsed = traffic.sent - sent_before, time.monotonic() - started
    print(
        f"\nrotation run: {traffic.sent} RPCs in all, {sent_during} during the 7 rotations "
        f"({elapsed:.1f} s), {len(traffic.failures)} failed; ROTATE "
        f"{[round(d * 1000) for d in durations['rotate']]} ms, RELOAD "
        f"{[round(d * 1000) for d in durations['reload']]} ms; RPC p50 "
        f"{statistics.median(traffic.latencies) * 1000:.1f} ms, max {max(traffic.latencies) * 1000:.0f} ms"
    )

    assert traffic.failures == []
    assert sent_during > len(PLAN) * 3 * CLIENTS

    # Every acknowledged memory is stored.
    acknowledged = set(traffic.acknowledged)
    assert len(acknowledged) == len(traffic.acknowledged) > 0
    async with superuser(own) as conn:
        stored = await conn.fetchval(
            "SELECT count(*) FROM memories WHERE id = ANY($1::uuid[])", list(acknowledged)
        )
    assert stored == len(acknowledged)

    # Only the current credential logs in; every earlier one is refused.
    current = source.read()
    assert current == used[-1]
    assert len({c.password for c in used}) == len(used)
    assert await login_error(own, current) is None
    for old in used[:-1]:
        assert await login_error(own, old) is asyncpg.InvalidPasswordError, old

    status = await admin.status()
    assert status.active_role == current.username
    assert status.credential_version == before.credential_version + len(PLAN)
    assert status.last_rotation_outcome == admin_pb2.ROTATION_OUTCOME_SUCCEEDED
    assert status.last_rotation_mode == admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE
    assert status.HasField("last_rotated_at")
    assert 1 <= status.pool_size <= running.settings.pool_max_size
    assert 0 <= status.pool_in_use <= status.pool_size
    assert [p.current for p in status.pepper_versions].count(True) == 1
    assert sum(p.row_count for p in status.pepper_versions) >= len(acknowledged)

    # The journal: seven succeeded rotations, in order, each with the next credential version.
    rows = await journal_rows(own, journal_start)
    assert [row["mode"] for row in rows] == ["rotate" if m == ROTATE else "reload" for m in PLAN]
    assert {(row["outcome"], row["step"]) for row in rows} == {("succeeded", "completed")}
    assert [row["version"] for row in rows] == list(
        range(before.credential_version + 1, before.credential_version + len(PLAN) + 1)
    )
    assert [row["to_role"] for row in rows] == [c.username for c in used[1:]]
    assert {row["actor"] for row in rows if row["mode"] == "rotate"} == {ADMIN_SPIFFE_ID}
    reload_actors = [row["actor"] for row in rows if row["mode"] == "reload"]
    assert set(reload_actors) <= {ADMIN_SPIFFE_ID, SYSTEM_ACTOR}
    print(f"RELOADs performed by: {reload_actors}")

    # The audit trail: who, what, outcome; no failures.
    rotations = await new_events(admin, audit_start, ROTATION_EVENTS)
    assert sorted(e.outcome for e in rotations) == [STARTED] * 5 + [SUCCEEDED] * 5
    assert {e.actor for e in rotations} == {ADMIN_SPIFFE_ID}
    assert [e.target for e in reversed(rotations) if e.outcome == SUCCEEDED] == [
        c.username for c, m in zip(used[1:], PLAN, strict=True) if m == ROTATE
    ]
    reloads = await new_events(admin, audit_start, RELOAD_EVENTS)
    succeeded = [e for e in reloads if e.outcome == SUCCEEDED]
    assert len(succeeded) == 2
    assert {e.actor for e in succeeded} <= {ADMIN_SPIFFE_ID, SYSTEM_ACTOR}
    # A RELOAD that found the file watcher already reloading was refused (and retried); on record.
    refused = {(e.actor, e.outcome, e.reason) for e in reloads if e.outcome != SUCCEEDED}
    assert refused <= {(ADMIN_SPIFFE_ID, FAILED, common_pb2.ERROR_REASON_ROTATION_IN_PROGRESS)}

    # No password ever used appears in the audit trail, the status or the journal.
    exposed = "\n".join([str(e) for e in rotations + reloads] + [str(status)] + [repr(dict(r)) for r in rows])
    for secret in [c.password for c in used] + [
        FileCredentialSource(d).read().password
        for d in (own.rotator_credential_dir, own.owner_credential_dir, own.superuser_credential_dir)
    ]:
        assert secret not in exposed


# --- failures leave the service on the old credential -----------------------------------------


async def test_reload_with_a_wrong_password_is_refused_and_serving_continues_on_new_connections(
    running: Service, admin: Admin, launchers: Launchers, own: SharedDatabase
) -> None:
    source = app_source(own)
    active = source.read()
    before = await admin.status()
    audit_start = await last_id(own, "audit_events")
    caller = launchers.caller()
    await serves(caller, "before the bad file")
    source.write(DatabaseCredential(other_role(active.username), "not-the-password"))
    try:
        refused = await failed_reload(admin)
        assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CREDENTIAL_INVALID")
        assert other_role(active.username) in refused.message
        assert "not-the-password" not in refused.message

        # Every pooled connection is replaced: the new ones still log in as the last good credential.
        assert running.database is not None
        expired_at = datetime.now(UTC)
        await running.database.pool.expire_connections()
        for word in ("after", "the", "bad", "file"):
            await serves(caller, word)
        async with superuser(own) as conn:
            fresh = await conn.fetch(
                "SELECT usename FROM pg_stat_activity WHERE application_name = 'tokensvc' "
                "AND backend_start > $1",
                expired_at,
            )
        assert fresh
        assert {row["usename"] for row in fresh} == {active.username}

        status = await admin.status()
        assert status.active_role == active.username
        assert status.credential_version == before.credential_version
        assert status.last_rotation_outcome == admin_pb2.ROTATION_OUTCOME_FAILED
        assert status.last_rotation_mode == admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD
        row = (await journal_rows(own))[-1]
        assert (row["mode"], row["outcome"], row["reason"]) == ("reload", "failed", "CREDENTIAL_INVALID")
        ours = await admin_reload_outcomes(admin, audit_start)
        assert ours == [(FAILED, common_pb2.ERROR_REASON_CREDENTIAL_INVALID)]
    finally:
        source.write(active)
    assert (await reload_rpc(admin)).active_role == active.username


async def test_reload_of_an_unreadable_secret_is_refused_and_recorded(
    running: Service, admin: Admin, own: SharedDatabase
) -> None:
    source = app_source(own)
    active = source.read()
    audit_start = await last_id(own, "audit_events")
    (own.app_credential_dir / "..data" / "password").write_text("\n")  # an empty password
    try:
        refused = await failed_reload(admin)
        assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CREDENTIAL_INVALID")
        ours = await admin_reload_outcomes(admin, audit_start)
        assert ours == [(FAILED, common_pb2.ERROR_REASON_CREDENTIAL_INVALID)]
        assert (await admin.status()).active_role == active.username
    finally:
        source.write(active)


async def test_rotate_with_a_broken_rotator_secret_fails_with_a_reason_and_is_recorded(
    running: Service, admin: Admin, launchers: Launchers, own: SharedDatabase
) -> None:
    source = app_source(own)
    active = source.read()
    inactive_had_password = await has_password(own, other_role(active.username))
    before = await admin.status()
    audit_start = await last_id(own, "audit_events")
    rotator = FileCredentialSource(own.rotator_credential_dir)
    good = rotator.read()
    rotator.write(DatabaseCredential(good.username, "a-broken-rotator-password"))
    try:
        refused = await failure(admin.rotate(ROTATE))
        assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "CREDENTIAL_INVALID")
        assert good.username in refused.message

        row = (await journal_rows(own))[-1]
        assert (row["mode"], row["step"], row["outcome"], row["reason"]) == (
            "rotate",
            "set_password",
            "failed",
            "CREDENTIAL_INVALID",
        )
        assert row["actor"] == ADMIN_SPIFFE_ID
        events = await new_events(admin, audit_start, ROTATION_EVENTS)
        assert [(e.outcome, e.actor) for e in reversed(events)] == [
            (STARTED, ADMIN_SPIFFE_ID),
            (FAILED, ADMIN_SPIFFE_ID),
        ]
        assert events[0].reason == common_pb2.ERROR_REASON_CREDENTIAL_INVALID

        # Nothing changed: the same credential serves, in the file and in the database.
        assert source.read() == active
        assert await has_password(own, other_role(active.username)) == inactive_had_password
        status = await admin.status()
        assert (status.active_role, status.credential_version) == (active.username, before.credential_version)
        assert status.last_rotation_outcome == admin_pb2.ROTATION_OUTCOME_FAILED
        await serves(launchers.caller(), "after the failed rotation")
    finally:
        rotator.write(good)
    # With the rotator secret repaired, the same rotation goes through.
    assert (await admin.rotate(ROTATE)).active_role == other_role(active.username)


async def test_two_concurrent_rotations_one_succeeds_the_other_is_aborted(
    running: Service, admin: Admin, launchers: Launchers, own: SharedDatabase
) -> None:
    active = app_source(own).read()
    before = await admin.status()
    audit_start = await last_id(own, "audit_events")
    results = await asyncio.gather(admin.rotate(ROTATE), admin.rotate(ROTATE), return_exceptions=True)

    succeeded = [r for r in results if isinstance(r, admin_pb2.CredentialStatus)]
    refused = [failure_of(r) for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert (len(succeeded), len(refused)) == (1, 1), results
    assert (refused[0].code, refused[0].reason) == (grpc.StatusCode.ABORTED, "ROTATION_IN_PROGRESS")
    assert succeeded[0].active_role == other_role(active.username) == app_source(own).read().username
    assert (await admin.status()).credential_version == before.credential_version + 1
    # The refused one is on the record too.
    events = await new_events(admin, audit_start, ROTATION_EVENTS)
    assert sorted((e.outcome, e.reason) for e in events) == sorted(
        [
            (STARTED, common_pb2.ERROR_REASON_UNSPECIFIED),
            (SUCCEEDED, common_pb2.ERROR_REASON_UNSPECIFIED),
            (FAILED, common_pb2.ERROR_REASON_ROTATION_IN_PROGRESS),
        ]
    )
    await serves(launchers.caller(), "after concurrent rotations")


async def test_rotate_without_a_rotator_credential_is_rotation_failed(
    start: Callable[..., Awaitable[Service]], dev: DevPaths, own: SharedDatabase
) -> None:
    service = await start(database_rotator_credential_dir=None)
    assert service.database is not None
    assert service.database.target.rotator_credentials is None
    admin = Admin(service.port, dev)
    try:
        before = await admin.status()
        refused = await failure(admin.rotate(ROTATE))
        assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ROTATION_FAILED")
        assert "database_rotator_credential_dir" in refused.message
        after = await admin.status()
        assert (after.active_role, after.credential_version) == (
            before.active_role,
            before.credential_version,
        )
        (event, *_) = await admin.events(ROTATION_EVENTS)
        assert (event.outcome, event.reason, event.actor) == (
            FAILED,
            common_pb2.ERROR_REASON_ROTATION_FAILED,
            ADMIN_SPIFFE_ID,
        )
    finally:
        await admin.aclose()


# --- the file watcher ---------------------------------------------------------------------------


async def test_an_externally_changed_secret_is_picked_up_by_itself_within_seconds(
    running: Service, admin: Admin, launchers: Launchers, own: SharedDatabase
) -> None:
    source = app_source(own)
    active = source.read()
    before = await admin.status()
    audit_start = await last_id(own, "audit_events")
    new = DatabaseCredential(other_role(active.username), generate_password())
    await rotator_set_password(own, new.username, new.password)
    source.write(new)

    changed_at = time.monotonic()
    status = before
    # Until the new role serves and the reload is closed in the journal (it switches, then closes).
    while (status.active_role, status.last_rotation_outcome) != (
        new.username,
        admin_pb2.ROTATION_OUTCOME_SUCCEEDED,
    ):
        assert time.monotonic() - changed_at < 10, "the watcher did not reload within 10 s"
        await asyncio.sleep(0.1)
        status = await admin.status()
    print(f"\nfile watcher reloaded after {time.monotonic() - changed_at:.2f} s")

    assert status.credential_version == before.credential_version + 1
    assert status.last_rotation_mode == admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD
    assert status.last_rotation_outcome == admin_pb2.ROTATION_OUTCOME_SUCCEEDED
    row = (await journal_rows(own))[-1]
    assert (row["mode"], row["actor"], row["outcome"]) == ("reload", SYSTEM_ACTOR, "succeeded")
    events = await new_events(admin, audit_start, RELOAD_EVENTS)
    assert [(e.actor, e.outcome, e.target) for e in events] == [(SYSTEM_ACTOR, SUCCEEDED, new.username)]

    # The previous login is retired; new connections serve on the new one.
    await rotator_set_password(own, active.username, None)
    assert running.database is not None
    await running.database.pool.expire_connections()
    await serves(launchers.caller(), "after the watcher reloaded")
    assert await login_error(own, active) is asyncpg.InvalidPasswordError
