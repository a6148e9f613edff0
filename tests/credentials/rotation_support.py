"""Helpers for the credential-rotation tests: a private database, admin calls, logins, traffic.

Rotation changes the login roles' passwords and the app secret files, so these tests never touch
the session's shared database: each module (or test) starts its own embedded PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.api.memory_support import Caller
from tests.support import (
    RpcFailure,
    SharedDatabase,
    connect_as,
    failure_of,
    role_channel,
    service_settings,
    superuser,
)
from tokensvc.app import locate_database, migrate
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import DatabaseCredential
from tokensvc.settings import Settings
from tokensvc.storage.postgres import EmbeddedPostgres
from tokensvc.storage.postgres.scram import scram_sha256_verifier
from tokensvc.v1 import admin_pb2, admin_pb2_grpc, memory_pb2

__all__ = [
    "LOGIN_ROLES",
    "RELOAD",
    "ROTATE",
    "Admin",
    "Traffic",
    "login_error",
    "other_role",
    "private_database",
    "rotator_set_password",
    "settings_json",
    "wait_until_serving",
]

LOGIN_ROLES = ("tokensvc_app_a", "tokensvc_app_b")
RELOAD = admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD
ROTATE = admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE
TIMEOUT = 30.0


def other_role(role: str) -> str:
    return LOGIN_ROLES[1] if role == LOGIN_ROLES[0] else LOGIN_ROLES[0]


# --- a private database -------------------------------------------------------------------------


@asynccontextmanager
async def private_database(dev: DevPaths) -> AsyncIterator[SharedDatabase]:
    """A fresh embedded PostgreSQL with the schema migrated, stopped and deleted afterwards.

    It lives outside pytest's temporary root on purpose: every pytest session starting on this
    host chmods that root back to 0700, and a postmaster launched as the unprivileged system
    user (when the tests run as root) then cannot reach its data directory.
    """
    directory = Path(tempfile.mkdtemp(prefix="tokensvc-rotation-"))
    server = EmbeddedPostgres(directory)
    try:
        await server.start()
        database = SharedDatabase(server)
        settings = service_settings(database, dev, directory)
        await migrate(await locate_database(settings), settings)
        yield database
    finally:
        await server.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def login_error(database: SharedDatabase, credential: DatabaseCredential) -> type[Exception] | None:
    """None when `credential` logs in to the tokensvc database, else the error class it got."""
    try:
        conn = await asyncpg.connect(
            database.dsn, user=credential.username, password=credential.password, timeout=10
        )
    except asyncpg.PostgresError as exc:
        return type(exc)
    await conn.close()
    return None


async def rotator_set_password(database: SharedDatabase, role: str, password: str | None) -> None:
    """Act as an external rotator: set (or remove) a login role's password, as a SCRAM verifier."""
    assert role in LOGIN_ROLES
    async with connect_as(database.rotator_credential_dir, database.dsn) as conn:
        value = "NULL" if password is None else f"'{scram_sha256_verifier(password)}'"
        await conn.execute(f"ALTER ROLE {role} PASSWORD {value}")


async def has_password(database: SharedDatabase, role: str) -> bool:
    async with superuser(database) as conn:
        return bool(
            await conn.fetchval("SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = $1", role)
        )


async def journal_rows(database: SharedDatabase, after_id: int = 0) -> list[asyncpg.Record]:
    async with superuser(database) as conn:
        return list(
            await conn.fetch("SELECT * FROM credential_rotations WHERE id > $1 ORDER BY id", after_id)
        )


_LAST_ID = {
    "credential_rotations": "SELECT coalesce(max(id), 0) FROM credential_rotations",
    "audit_events": "SELECT coalesce(max(id), 0) FROM audit_events",
}


async def last_id(database: SharedDatabase, table: str) -> int:
    """The newest row id of `credential_rotations` or `audit_events` (0 when empty)."""
    async with superuser(database) as conn:
        return int(await conn.fetchval(_LAST_ID[table]))


# --- the admin API ------------------------------------------------------------------------------


class Admin:
    """AdminService over mTLS with the dev admin certificate."""

    def __init__(self, port: int, dev: DevPaths, role: str = "admin"):
        self.channel = role_channel(port, dev, role)
        self.stub = admin_pb2_grpc.AdminServiceStub(self.channel)

    async def rotate(self, mode: int) -> admin_pb2.CredentialStatus:
        request = admin_pb2.RotateDatabaseCredentialsRequest(mode=mode)  # type: ignore[arg-type]
        response = await self.stub.RotateDatabaseCredentials(request, timeout=TIMEOUT)
        return response.status

    async def status(self) -> admin_pb2.CredentialStatus:
        response = await self.stub.GetCredentialStatus(
            admin_pb2.GetCredentialStatusRequest(), timeout=TIMEOUT
        )
        return response.status

    async def events(
        self, *kinds: int, since: datetime | None = None, page_size: int = 100
    ) -> list[admin_pb2.AuditEvent]:
        """Every audit event (newest first) of these kinds, following page tokens to the end."""
        events: list[admin_pb2.AuditEvent] = []
        token = ""
        while True:
            request = admin_pb2.ListAuditEventsRequest(
                page_size=page_size,
                page_token=token,
                kinds=kinds,  # type: ignore[arg-type]
            )
            if since is not None:
                request.since.FromDatetime(since)
            response = await self.stub.ListAuditEvents(request, timeout=TIMEOUT)
            events.extend(response.events)
            token = response.next_page_token
            if not token:
                return events

    async def aclose(self) -> None:
        await self.channel.close(grace=None)


async def failure(call: Awaitable[Any]) -> RpcFailure:
    """The decoded status of a call that must fail."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return failure_of(exc)
    raise AssertionError("the call succeeded")


# --- sustained traffic --------------------------------------------------------------------------


@dataclass
class Traffic:
    """Remember + SearchMemories in a loop from several callers until stopped; counts everything."""

    callers: Sequence[Caller]
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._client(index, caller), name=f"traffic-{index}")
            for index, caller in enumerate(self.callers)
        ]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def wait_for(self, more: int, within: float = 60) -> None:
        """Until `more` further RPCs have completed (so rotations happen under real load)."""
        target = self.sent + more
        deadline = time.monotonic() + within
        while self.sent < target:
            assert time.monotonic() < deadline, f"traffic stalled at {self.sent} RPCs"
            assert all(not task.done() for task in self._tasks), "a traffic client stopped"
            await asyncio.sleep(0.01)

    async def _client(self, index: int, caller: Caller) -> None:
        number = 0
        while not self._stop.is_set():
            number += 1
            remember = memory_pb2.RememberRequest(
                items=[memory_pb2.RememberItem(content=f"client {index} fact {number} about rivers")]
            )
            search = memory_pb2.SearchMemoriesRequest(query_text=f"fact {number} rivers", top_k=5)
            for rpc, request in (("Remember", remember), ("SearchMemories", search)):
                started = time.monotonic()
                try:
                    response = await caller.call(rpc, request)
                except grpc.aio.AioRpcError as exc:
                    self.failures.append(f"{rpc}: {exc.code().name} {exc.details()}")
                else:
                    if rpc == "Remember":
                        self.acknowledged.extend(result.id for result in response.results)
                self.latencies.append(time.monotonic() - started)
                self.sent += 1


# --- a tokensvc in a subprocess -----------------------------------------------------------------


def settings_json(settings: Settings, path: Path) -> Path:
    """Write `settings` as the JSON overrides `tests.credentials.crash_server` loads."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(settings):
        value = getattr(settings, item.name)
        if value is None:
            continue
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        values[item.name] = value
    path.write_text(json.dumps(values))
    return path


async def wait_until_serving(
    port: int, dev: DevPaths, alive: Callable[[], bool] | None = None, within: float = 60
) -> None:
    """Poll the health service over mTLS until it reports SERVING; `alive()` False aborts."""
    deadline = time.monotonic() + within
    async with role_channel(port, dev, "admin") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if alive is not None and not alive():
                raise AssertionError("the tokensvc process exited before serving")
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "tokensvc did not report SERVING in time"
            await asyncio.sleep(0.2)
