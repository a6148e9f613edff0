"""Shared machinery of the fault, crash and load tests.

- state directories for a service with its own (embedded) PostgreSQL, and settings for it;
- the embedded server seen from outside: its postmaster pid and port (from `postmaster.pid`), a
  superuser connection, and a clean stop of a postmaster the test left behind;
- tenants: a launcher certificate per agent, a capability per (agent, user), the bucket the
  capability must map to (computed here from the pepper, independently of the server);
- the integrity checks every fault test ends with: no memory and no chunk half-written;
- a health trace (a `Health.Watch` stream plus `Health.Check` polls, time-stamped);
- `report`: measured numbers, printed by the test and again in pytest's terminal summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import RpcFailure, connect_as, dev_capability, failure_of, mtls_channel
from tokensvc.auth.buckets import PepperKeyring, bucket_id
from tokensvc.auth.devpki import (
    ADMIN_SPIFFE_ID,
    CONTROL_PLANE_SPIFFE_ID,
    DEV_TRUST_DOMAIN,
    DevPaths,
    issue_client_certificate,
)
from tokensvc.settings import Settings
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres.embedded import DATABASE_NAME, process_alive
from tokensvc.v1 import memory_pb2, memory_pb2_grpc

NAMESPACE = "default"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Measured numbers of this session, repeated in the terminal summary (see conftest.py).
MEASUREMENTS: list[str] = []


def report(title: str, **numbers: Any) -> None:
    parts = ", ".join(f"{key}={_format(value)}" for key, value in numbers.items())
    line = f"{title}: {parts}"
    MEASUREMENTS.append(line)
    print(line)


def _format(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(fraction * 100) - 1]


# --- a state directory with its own PostgreSQL ------------------------------------------------


def new_state_dir(prefix: str) -> Path:
    """A fresh state dir outside pytest's basetemp.

    Under root the embedded PostgreSQL runs as an unprivileged user that must traverse the path;
    another pytest session resets the basetemp tree to mode 0700 (see tests/conftest.py).
    """
    return Path(tempfile.mkdtemp(prefix=f"tokensvc-{prefix}-"))


def dev_overrides(dev: DevPaths) -> dict[str, Any]:
    """The dev TLS, trust and pepper files (tests/support.py `service_settings` minus the database)."""
    return {
        "tls_cert_file": str(dev.server_cert),
        "tls_key_file": str(dev.server_key),
        "tls_client_ca_file": str(dev.ca_cert),
        "trust_domain": DEV_TRUST_DOMAIN,
        "admin_spiffe_ids": [ADMIN_SPIFFE_ID],
        "control_plane_spiffe_ids": [CONTROL_PLANE_SPIFFE_ID],
        "trust_bundle_file": str(dev.trust_bundle),
        "pepper_dir": str(dev.pepper_dir),
        "signing_key_file": str(dev.signing_key),
    }


def embedded_settings(state: Path, dev: DevPaths, **overrides: Any) -> Settings:
    """Settings for an in-process service whose PostgreSQL is embedded in `state` (no DSN)."""
    values: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "state_dir": str(state),
        "migrate_on_start": True,
        "shutdown_grace_seconds": 1.0,
        **dev_overrides(dev),
    }
    values.update(overrides)
    return load_settings(environ={}, overrides=values)


def _postmaster_lines(state: Path) -> list[str]:
    try:
        return (state / "postgres" / "data" / "postmaster.pid").read_text().splitlines()
    except OSError:
        return []


def postmaster_pid(state: Path) -> int | None:
    """The pid of the live postmaster of `state`, from its `postmaster.pid`."""
    lines = _postmaster_lines(state)
    try:
        pid = int(lines[0])
    except (IndexError, ValueError):
        return None
    return pid if process_alive(pid) else None


def postmaster_port(state: Path) -> int:
    return int(_postmaster_lines(state)[3])


async def stop_postmaster(state: Path, grace: float = 30.0) -> None:
    """Fast shutdown (SIGINT) of a postmaster left running in `state`; SIGKILL after `grace` s."""
    pid = postmaster_pid(state)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    try:
        await wait_until(lambda: not process_alive(pid), grace, "the postmaster to stop", interval=0.05)
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def wait_until(condition: Any, within: float, what: str, interval: float = 0.02) -> float:
    """Poll `condition()` until true; the seconds it took. AssertionError naming `what` after `within` s."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - started


def superuser(state: Path) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """The embedded database of `state` as its superuser (no row-level security)."""
    return connect_as(
        state / "secrets" / "db" / "superuser",
        host="127.0.0.1",
        port=postmaster_port(state),
        database=DATABASE_NAME,
        timeout=10,
    )


# --- integrity ----------------------------------------------------------------------------------


async def half_written_memories(conn: asyncpg.Connection) -> list[str]:
    """Memory rows whose content, hash, embedding and space disagree (must be none)."""
    rows = await conn.fetch(
        "SELECT m.bucket || '/' || m.id::text AS what FROM memories m "
        "LEFT JOIN memory_spaces s ON (s.namespace, s.agent) = (m.namespace, m.agent) "
        "WHERE m.content = '' OR m.content_sha256 IS DISTINCT FROM sha256(convert_to(m.content, 'UTF8')) "
        "OR vector_dims(m.embedding) <> m.dimension OR s.dimension IS DISTINCT FROM m.dimension"
    )
    return [row["what"] for row in rows]


async def knowledge_violations(conn: asyncpg.Connection) -> dict[str, list[str]]:
    """Every way the knowledge tables could be inconsistent, with the offending rows (must be empty)."""
    checks = {
        "chunk without its document": (
            "SELECT c.kb_ref || '/' || c.doc_ref || '#' || c.chunk_index FROM chunks c "
            "WHERE NOT EXISTS (SELECT 1 FROM documents d WHERE (d.namespace, d.kb_ref, d.ref) = "
            "(c.namespace, c.kb_ref, c.doc_ref))"
        ),
        "document without its knowledge base": (
            "SELECT d.kb_ref || '/' || d.ref FROM documents d WHERE NOT EXISTS "
            "(SELECT 1 FROM knowledge_bases k WHERE (k.namespace, k.ref) = (d.namespace, d.kb_ref))"
        ),
        "chunk_count differs from its chunks": (
            "SELECT d.kb_ref || '/' || d.ref || ' says ' || d.chunk_count || ', has ' || "
            "(SELECT count(*) FROM chunks c WHERE (c.namespace, c.kb_ref, c.doc_ref) = "
            "(d.namespace, d.kb_ref, d.ref)) FROM documents d WHERE d.chunk_count <> "
            "(SELECT count(*) FROM chunks c WHERE (c.namespace, c.kb_ref, c.doc_ref) = "
            "(d.namespace, d.kb_ref, d.ref))"
        ),
        "chunk of another version than its document's": (
            "SELECT c.kb_ref || '/' || c.doc_ref || ' v' || c.version || ' (document v' || d.version || ')' "
            "FROM chunks c JOIN documents d ON (d.namespace, d.kb_ref, d.ref) = "
            "(c.namespace, c.kb_ref, c.doc_ref) WHERE c.version <> d.version"
        ),
        "chunk indexes not 0..n-1": (
            "SELECT c.kb_ref || '/' || c.doc_ref FROM chunks c GROUP BY c.namespace, c.kb_ref, c.doc_ref "
            "HAVING min(c.chunk_index) <> 0 OR max(c.chunk_index) <> count(*) - 1"
        ),
        "chunk embedding of the wrong size": (
            "SELECT c.kb_ref || '/' || c.doc_ref || '#' || c.chunk_index FROM chunks c "
            "JOIN knowledge_bases k ON (k.namespace, k.ref) = (c.namespace, c.kb_ref) "
            "WHERE vector_dims(c.embedding) <> c.dimension OR c.dimension <> k.dimension"
        ),
    }
    found: dict[str, list[str]] = {}
    for name, sql in checks.items():
        rows = [str(row[0]) for row in await conn.fetch(sql)]
        if rows:
            found[name] = rows
    return found


# --- tenants ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """One launcher (agent certificate) with one capability (optionally for one end-user)."""

    agent: str
    user: str | None
    per_user: bool
    certificate: tuple[Path, Path]
    token: str
    bucket: str  # what the server must derive, computed here from the pepper

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    @property
    def tag(self) -> str:
        return f"{self.agent}.{self.user or 'agent'}"


class Tenants:
    """Issues agent certificates and capabilities from a dev state's CA and signing key."""

    def __init__(self, dev: DevPaths, directory: Path):
        self.dev = dev
        self.directory = directory
        self._keyring = PepperKeyring.load(dev.pepper_dir)
        self._certificates: dict[str, tuple[Path, Path]] = {}

    def agent(self) -> str:
        agent = f"agent-{uuid.uuid4().hex[:8]}"
        spiffe_id = f"spiffe://{DEV_TRUST_DOMAIN}/ns/{NAMESPACE}/sa/{agent}"
        self._certificates[agent] = issue_client_certificate(self.dev, spiffe_id, self.directory, name=agent)
        return agent

    def tenant(
        self,
        agent: str | None = None,
        *,
        user: str | None = None,
        per_user: bool = False,
        knowledge_bases: Sequence[str] = (),
    ) -> Tenant:
        agent = agent or self.agent()
        token = dev_capability(
            self.dev,
            namespace=NAMESPACE,
            agent=agent,
            user=user,
            per_user=per_user,
            long_term_memory=True,
            knowledge_bases=list(knowledge_bases),
        )
        bucket = bucket_id(self._keyring, NAMESPACE, agent, user if per_user else None)
        return Tenant(agent, user, per_user, self._certificates[agent], token, bucket)

    def channel(self, port: int, tenant: Tenant) -> grpc.aio.Channel:
        return mtls_channel(port, self.dev.ca_cert, *tenant.certificate)


# --- health -------------------------------------------------------------------------------------


@dataclass
class HealthTrace:
    """Time-stamped health statuses of one server: every `Watch` update and every `Check` poll."""

    port: int
    dev: DevPaths
    poll_interval: float = 0.02
    events: list[tuple[float, int, str]] = field(default_factory=list)  # (monotonic, status, source)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _channel: grpc.aio.Channel | None = None

    async def start(self) -> None:
        cert, key = self.dev.client("launcher")
        self._channel = mtls_channel(self.port, self.dev.ca_cert, cert, key)
        stub = health_pb2_grpc.HealthStub(self._channel)
        self._tasks = [asyncio.create_task(self._watch(stub)), asyncio.create_task(self._poll(stub))]
        await wait_until(lambda: any(e[2] == "watch" for e in self.events), 10, "the first Watch update")

    async def _watch(self, stub: health_pb2_grpc.HealthStub) -> None:
        async for response in stub.Watch(health_pb2.HealthCheckRequest()):
            self.events.append((time.monotonic(), response.status, "watch"))

    async def _poll(self, stub: health_pb2_grpc.HealthStub) -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                self.events.append((time.monotonic(), response.status, "check"))
            await asyncio.sleep(self.poll_interval)

    def first(self, status: int, after: float) -> float | None:
        """When `status` was first seen after `after` (monotonic), or None."""
        return next((t for t, s, _ in sorted(self.events) if t >= after and s == status), None)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close(grace=None)


# --- Remember traffic ------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    tenant: Tenant
    contents: tuple[str, ...]
    started: float
    finished: float
    ids: tuple[str, ...] = ()
    failure: RpcFailure | None = None

    @property
    def latency(self) -> float:
        return self.finished - self.started


class RememberTraffic:
    """`workers` tasks calling Remember (1 to 3 fresh items each) until stopped; every outcome kept."""

    def __init__(self, port: int, tenants: Tenants, callers: Sequence[Tenant], workers: int, timeout: float):
        self._callers = callers
        self._channels = {caller.tag: tenants.channel(port, caller) for caller in callers}
        self._workers = workers
        self._timeout = timeout
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.attempts: list[Attempt] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(index)) for index in range(self._workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for channel in self._channels.values():
            await channel.close(grace=None)

    async def _work(self, index: int) -> None:
        tenant = self._callers[index % len(self._callers)]
        stub = memory_pb2_grpc.MemoryServiceStub(self._channels[tenant.tag])
        call = 0
        while not self._stop.is_set():
            call += 1
            contents = tuple(
                f"{tenant.tag} worker {index} call {call} item {item} {uuid.uuid4().hex}"
                for item in range(1 + call % 3)
            )
            request = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=c) for c in contents])
            started = time.monotonic()
            try:
                response = await stub.Remember(request, metadata=tenant.metadata, timeout=self._timeout)
            except grpc.aio.AioRpcError as error:
                failure = failure_of(error)
                self.attempts.append(Attempt(tenant, contents, started, time.monotonic(), failure=failure))
                await asyncio.sleep(0.01)
            else:
                ids = tuple(result.id for result in response.results)
                self.attempts.append(Attempt(tenant, contents, started, time.monotonic(), ids=ids))

    def acknowledged(self, since: float = 0.0) -> int:
        return sum(1 for a in self.attempts if a.failure is None and a.started >= since)

    @property
    def failures(self) -> list[Attempt]:
        return [a for a in self.attempts if a.failure is not None]


@dataclass(frozen=True)
class MemoryOutcome:
    acknowledged: int  # memories whose Remember call was answered OK
    failed_batches: int  # Remember calls that failed
    committed_anyway: int  # failed calls whose batch was stored (whole) nonetheless


async def check_remembered(
    state: Path, traffic: Sequence[RememberTraffic], callers: Sequence[Tenant]
) -> MemoryOutcome:
    """Every memory `traffic` had acknowledged is stored as sent, in its tenant's bucket; nothing
    is half-written (`traffic`: everything that ever wrote to these tenants' buckets).

    Also: every row of these buckets is something a call tried to write, and a failed Remember
    batch is stored whole or not at all (an unacknowledged write may have committed).
    """
    attempts = [attempt for run in traffic for attempt in run.attempts]
    acknowledged = {
        memory_id: (attempt.tenant.bucket, content)
        for attempt in attempts
        if attempt.failure is None
        for memory_id, content in zip(attempt.ids, attempt.contents, strict=True)
    }
    attempted = {content for attempt in attempts for content in attempt.contents}
    async with superuser(state) as conn:
        rows = await conn.fetch(
            "SELECT id::text AS id, bucket, content FROM memories WHERE bucket = ANY($1::text[])",
            [caller.bucket for caller in callers],
        )
        half_written = await half_written_memories(conn)
    stored = {row["id"]: (row["bucket"], row["content"]) for row in rows}

    missing = [memory_id for memory_id in acknowledged if memory_id not in stored]
    assert not missing, f"{len(missing)} acknowledged memories are gone, e.g. {missing[:3]}"
    altered = [memory_id for memory_id, row in acknowledged.items() if stored[memory_id] != row]
    assert not altered, f"acknowledged memories stored with other content or bucket: {altered[:3]}"
    assert not half_written, f"half-written memory rows: {half_written[:5]}"
    stray = [memory_id for memory_id, (_, content) in stored.items() if content not in attempted]
    assert not stray, f"rows no call tried to write: {stray[:3]}"
    contents = {content for _, content in stored.values()}
    failures = [attempt for attempt in attempts if attempt.failure is not None]
    partial = [a.contents for a in failures if 0 < len(set(a.contents) & contents) < len(a.contents)]
    assert not partial, f"failed Remember batches stored in part: {partial[:3]}"
    return MemoryOutcome(
        acknowledged=len(acknowledged),
        failed_batches=len(failures),
        committed_anyway=sum(1 for a in failures if set(a.contents) <= contents),
    )
