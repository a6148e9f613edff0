"""The one asyncpg pool tokensvc owns, and where its connection details come from.

Credentials are read from the secret source for every new connection (so a rotated credential is
picked up without a restart); pgvector's binary codec is registered on every pooled connection
(text encoding of a 1536-d vector costs ~0.7 ms, binary ~1 us).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
from pgvector.asyncpg import register_vector

from tokensvc.settings import SettingsError
from tokensvc.storage.postgres.citus import citus_version, distribute
from tokensvc.storage.postgres.embedded import EmbeddedPostgres
from tokensvc.storage.postgres.schema_migrations import (
    LOCK_ID,
    apply_schema_migrations,
    available_schema_migrations,
    schema_version,
)
from tokensvc.storage.postgres.tenant import DistributedConnection
from tokensvc.storage.records import DatabaseCredential
from tokensvc.storage.secrets import FileCredentialSource

__all__ = ["Database", "DatabaseLocation", "DatabaseTarget", "connect_once"]

_log = logging.getLogger(__name__)

SCHEMA = "tokensvc"
_SERVER_SETTINGS = {
    "search_path": f"{SCHEMA}, public",
    "application_name": "tokensvc",
    # Every tenant statement names its bucket, so a plan for its parameters reads and locks one
    # partition of `memories`. A generic plan (what a prepared statement turns to after five
    # runs) cannot prune at planning: it locks all 256 partitions on every execution (260 locks,
    # 195 past the fast path), which costs little alone and serialises concurrent searches on the
    # lock manager (docs/benchmarks.md, "Cost growth"). Tested in tests/storage/test_memory_rls.py.
    "plan_cache_mode": "force_custom_plan",
}
# On a Citus coordinator. Citus hides shard tables from pg_class by a filter on every catalog
# query; asyncpg's type introspection (the first statement with a new type on each connection,
# e.g. a bytea[] parameter) then scanned pg_class once per type, 15 s instead of 30 ms
# (measured). tokensvc never looks for tables by name, so it sees the catalog unfiltered.
_CITUS_SERVER_SETTINGS = {"citus.override_table_visibility": "off"}


@dataclass(frozen=True)
class DatabaseLocation:
    """What `Database.locate` needs to know: where the database is (no DSN: the embedded server
    in `state_dir`) and the directories of the secrets that log in to it (unset ones of the
    embedded server are its own). The composition root makes it from the settings."""

    dsn: str | None
    state_dir: Path
    connect_timeout: float
    pool_sizes: tuple[int, int]
    app_credential_dir: Path | None = None
    owner_credential_dir: Path | None = None
    rotator_credential_dir: Path | None = None
    runner_credential_dir: Path | None = None


@dataclass(frozen=True)
class DatabaseTarget:
    """Where the database is (no secrets) and which secret sources log in to it."""

    host: str
    port: int
    database: str
    app_credentials: FileCredentialSource
    owner_credentials: FileCredentialSource | None
    connect_timeout: float
    rotator_credentials: FileCredentialSource | None = None
    # The re-embedding runner's login (migration 0021); None: this replica runs no migrations.
    runner_credentials: FileCredentialSource | None = None
    # Whether the database is a Citus coordinator: found when the pool opens.
    citus: bool = False

    @classmethod
    def from_dsn(
        cls,
        dsn: str,
        app_dir: Path,
        owner_dir: Path | None,
        connect_timeout: float,
    ) -> DatabaseTarget:
        parts = urlsplit(dsn)
        if not parts.hostname or not parts.path.strip("/"):
            raise SettingsError("database_dsn: needs a host and a database name")
        return cls(
            host=parts.hostname,
            port=parts.port or 5432,
            database=parts.path.strip("/"),
            app_credentials=FileCredentialSource(app_dir),
            owner_credentials=FileCredentialSource(owner_dir) if owner_dir else None,
            connect_timeout=connect_timeout,
        )


async def connect_once(
    target: DatabaseTarget, credential: DatabaseCredential, **kwargs: Any
) -> asyncpg.Connection:
    """One connection with the given credential and our session settings (and Citus's, when the
    target is known to be a coordinator)."""
    return await asyncpg.connect(
        host=target.host,
        port=target.port,
        database=target.database,
        user=credential.username,
        password=credential.password,
        timeout=target.connect_timeout,
        server_settings=_SERVER_SETTINGS | (_CITUS_SERVER_SETTINGS if target.citus else {}),
        **kwargs,
    )


async def _init_connection(conn: asyncpg.Connection) -> None:
    await register_vector(conn, schema="public")
    # jsonb as Python objects both ways (asyncpg's default is text).
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset on release: nothing to send.

    asyncpg's default sends `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`
    on every release, a round trip per call. tokensvc sets nothing that outlives a transaction
    (tenant_transaction: `set_config(..., true)` only; no session locks, cursors, LISTEN or SET on
    pooled connections), and asyncpg still rolls back a transaction left open before this runs.
    """


class Database:
    """Owns the embedded server (if any), the serving pool and the re-embedding runner's pool."""

    def __init__(
        self, target: DatabaseTarget, embedded: EmbeddedPostgres | None, pool_sizes: tuple[int, int]
    ):
        self.target = target
        self.embedded = embedded
        self._pool_sizes = pool_sizes
        self._pool: asyncpg.Pool | None = None
        self._runner_pool: asyncpg.Pool | None = None
        self._credential: Callable[[], DatabaseCredential] = target.app_credentials.read
        # The Citus version of the database served, None for a single PostgreSQL node; known
        # once the pool is open.
        self.citus: str | None = None

    @classmethod
    async def locate(cls, location: DatabaseLocation) -> Database:
        """Start the embedded database when none is configured; nothing is connected yet."""
        if location.dsn is not None:
            assert location.app_credential_dir is not None
            target = DatabaseTarget.from_dsn(
                location.dsn,
                location.app_credential_dir,
                location.owner_credential_dir,
                location.connect_timeout,
            )
            if location.rotator_credential_dir is not None:
                target = replace(
                    target, rotator_credentials=FileCredentialSource(location.rotator_credential_dir)
                )
            if location.runner_credential_dir is not None:
                target = replace(
                    target, runner_credentials=FileCredentialSource(location.runner_credential_dir)
                )
            return cls(target, None, location.pool_sizes)
        embedded = EmbeddedPostgres(location.state_dir)
        await embedded.start()
        paths = embedded.paths
        target = DatabaseTarget.from_dsn(
            embedded.dsn(),
            location.app_credential_dir or paths.credential_dir("app"),
            location.owner_credential_dir or paths.credential_dir("owner"),
            location.connect_timeout,
        )
        rotator = location.rotator_credential_dir or paths.credential_dir("rotator")
        runner = location.runner_credential_dir or paths.credential_dir("runner")
        target = replace(
            target,
            rotator_credentials=FileCredentialSource(rotator),
            runner_credentials=FileCredentialSource(runner),
        )
        return cls(target, embedded, location.pool_sizes)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("Database.open_pool() has not run")
        return self._pool

    async def open_pool(self, credential: Callable[[], DatabaseCredential] | None = None) -> asyncpg.Pool:
        """The serving pool; `credential` is asked for every new connection (rotation needs no restart)."""
        target = self.target
        current = self._credential = credential or target.app_credentials.read
        login = current()
        probe = await connect_once(target, login)
        try:
            self.citus = await citus_version(probe)
            if await probe.fetchval("SHOW track_activities") != "off":
                _log.warning(
                    "track_activities is on for the serving role %s: a session of that role can read "
                    "the bucket ids other sessions declare in pg_stat_activity; as a superuser, "
                    "ALTER ROLE ... SET track_activities = off for each login role "
                    '(docs/operations.md, "Database roles")',
                    login.username,
                )
        finally:
            await probe.close(timeout=target.connect_timeout)
        if self.citus is not None:
            _log.info("the database is a Citus %s coordinator: tenant settings reach its workers", self.citus)
            target = self.target = replace(target, citus=True)
        connection_class: type[asyncpg.Connection] = (
            asyncpg.Connection if self.citus is None else DistributedConnection
        )

        def connect_with_current_credential(*args: Any, **kwargs: Any) -> Awaitable[asyncpg.Connection]:
            return connect_once(target, current(), **kwargs)

        # asyncpg-stubs types `connect` as asyncpg.connect's full signature; ours forwards kwargs.
        connect: Any = connect_with_current_credential
        self._pool = await asyncpg.create_pool(
            min_size=self._pool_sizes[0],
            max_size=self._pool_sizes[1],
            connect=connect,
            init=_init_connection,
            reset=_keep_session,
            connection_class=connection_class,
        )
        return self._pool

    @property
    def runner_pool(self) -> asyncpg.Pool | None:
        """The re-embedding runner's pool (`open_runner_pool`), None when not open."""
        return self._runner_pool

    async def open_runner_pool(
        self, current: Callable[[], DatabaseCredential], max_size: int
    ) -> asyncpg.Pool:
        """The re-embedding runner's own pool, on its own login role (migration 0021), which
        `current()` names for each new connection (the runner's credential custodian: a rotation
        retires the open ones). Open the serving pool first (it finds Citus)."""
        target = self.target

        def connect_with_current_credential(*args: Any, **kwargs: Any) -> Awaitable[asyncpg.Connection]:
            return connect_once(target, current(), **kwargs)

        connect: Any = connect_with_current_credential
        self._runner_pool = await asyncpg.create_pool(
            min_size=0,
            max_size=max_size,
            connect=connect,
            init=_init_connection,
            reset=_keep_session,
            connection_class=asyncpg.Connection if self.citus is None else DistributedConnection,
        )
        return self._runner_pool

    async def schema_versions(self) -> tuple[int, int]:
        """(the schema version the database is at, the version this tokensvc's migrations reach)."""
        async with self.pool.acquire() as conn:
            have = await schema_version(conn)  # type: ignore[arg-type]
        return have, len(available_schema_migrations())

    async def migrate(self, app_role: str, runner_role: str = "tokensvc_runner") -> list[str]:
        """Apply pending migrations as the schema owner; returns the names applied."""
        owner = self.target.owner_credentials
        if owner is None:
            raise SettingsError("database_owner_credential_dir: required to migrate")
        conn = await connect_once(self.target, owner.read())
        try:
            applied = [
                change.label
                for change in await apply_schema_migrations(conn, app_role=app_role, runner_role=runner_role)
            ]
            if await citus_version(conn) is not None:
                applied += [f"citus: distributed {table}" for table in await distribute(conn, LOCK_ID)]
        finally:
            await conn.close()
        return applied

    async def connect(self) -> asyncpg.Connection:
        """A connection of its own, outside the pool (for session state such as LISTEN), with the
        credential the pool would use for a new connection now."""
        return await connect_once(self.target, self._credential())

    async def close(self) -> None:
        if self._runner_pool is not None:
            await self._runner_pool.close()
            self._runner_pool = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self.embedded is not None:
            await self.embedded.stop()
