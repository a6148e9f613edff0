"""A throwaway world to measure in: embedded PostgreSQL, dev PKI, an in-process tokensvc over mTLS.

Everything lives in temporary directories that are removed at the end. The PostgreSQL server is the
same embedded PostgreSQL 18 + pgvector the tests use, migrated by the schema owner; the service is
`tokensvc.app.Service` configured the production way (DSN + credential directories), serving mTLS
gRPC on a free port of 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from tokensvc.app import Service, migrate
from tokensvc.auth.buckets import PepperKeyring
from tokensvc.auth.capabilities import mint_capability
from tokensvc.auth.devpki import (
    ADMIN_SPIFFE_ID,
    CONTROL_PLANE_SPIFFE_ID,
    DEV_TRUST_DOMAIN,
    DevPaths,
    ensure_dev_material,
    load_signing_key,
)
from tokensvc.credentials import FileCredentialSource
from tokensvc.settings import Settings, load_settings
from tokensvc.storage.postgres import Database, EmbeddedPostgres

__all__ = ["BenchEnv", "bench_env", "connect_as"]

NAMESPACE = "default"
AGENT = "dev-agent"  # the dev launcher certificate's workload: spiffe://dev.local/ns/default/sa/dev-agent


@dataclass
class BenchEnv:
    root: Path
    dev: DevPaths
    postgres: EmbeddedPostgres
    settings: Settings
    service: Service | None = None
    keyring: PepperKeyring = field(init=False)

    def __post_init__(self) -> None:
        self.keyring = PepperKeyring.load(self.dev.pepper_dir)

    @property
    def dsn(self) -> str:
        return self.postgres.dsn()

    def credential(self, who: str) -> tuple[str, str]:
        """(username, password) of `superuser`, `owner` or `app`."""
        credential = FileCredentialSource(self.postgres.paths.credential_dir(who)).read()
        return credential.username, credential.password

    def conninfo(self, who: str, database: str | None = None) -> dict[str, Any]:
        user, password = self.credential(who)
        port = self.postgres.port
        assert port is not None
        return {
            "host": "127.0.0.1",
            "port": port,
            "user": user,
            "password": password,
            "database": database or self.dsn.rsplit("/", 1)[1],
        }

    def capability(self, **claims: Any) -> str:
        """A capability signed with the dev key for the dev launcher (namespace `default`, agent
        `dev-agent`) unless `claims` (mint_capability's keyword arguments) say otherwise."""
        kid, key = load_signing_key(self.dev.signing_key)
        values: dict[str, Any] = {"namespace": NAMESPACE, "agent": AGENT, **claims}
        return mint_capability(
            key, kid, issuer="ctxmesh-control-plane", audience="tokensvc", now=time.time(), **values
        )

    async def start_service(self, **overrides: Any) -> Service:
        """(Re)start tokensvc with these settings overrides (a restart drops every cache)."""
        await self.stop_service()
        self.settings = service_settings(self.root, self.dev, self.postgres, **overrides)
        self.service = Service(self.settings)
        await self.service.start()
        return self.service

    async def stop_service(self) -> None:
        if self.service is not None:
            await self.service.stop(grace=0)
            self.service = None


def service_settings(root: Path, dev: DevPaths, postgres: EmbeddedPostgres, **overrides: Any) -> Settings:
    paths = postgres.paths
    values: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "state_dir": str(root / "state"),
        "database_dsn": postgres.dsn(),
        "database_credential_dir": str(paths.credential_dir("app")),
        "database_owner_credential_dir": str(paths.credential_dir("owner")),
        "database_rotator_credential_dir": str(paths.credential_dir("rotator")),
        "tls_cert_file": str(dev.server_cert),
        "tls_key_file": str(dev.server_key),
        "tls_client_ca_file": str(dev.ca_cert),
        "trust_domain": DEV_TRUST_DOMAIN,
        "admin_spiffe_ids": [ADMIN_SPIFFE_ID],
        "control_plane_spiffe_ids": [CONTROL_PLANE_SPIFFE_ID],
        "trust_bundle_file": str(dev.trust_bundle),
        "pepper_dir": str(dev.pepper_dir),
        "signing_key_file": str(dev.signing_key),
        "shutdown_grace_seconds": 1.0,
        "log_level": "WARNING",
    }
    values.update(overrides)
    return load_settings(environ={}, overrides=values)


async def connect_as(env: BenchEnv, who: str, database: str | None = None) -> asyncpg.Connection:
    """A plain connection (pgvector binary codec, jsonb as Python objects, tokensvc search_path)."""
    conn = await asyncpg.connect(
        **env.conninfo(who, database), server_settings={"search_path": "tokensvc, public"}
    )
    await register_vector(conn, schema="public")
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
    return conn


@asynccontextmanager
async def bench_env() -> AsyncIterator[BenchEnv]:
    """A migrated embedded PostgreSQL and the dev PKI in temporary directories (no service yet)."""
    root = Path(tempfile.mkdtemp(prefix="tokensvc-bench-"))
    # PostgreSQL's data directory is not under `root`: when we run as root it is owned by an
    # unprivileged system user, and mkdtemp gives it a directory of its own.
    pg_state = Path(tempfile.mkdtemp(prefix="tokensvc-bench-pg-"))
    postgres = EmbeddedPostgres(pg_state)
    env: BenchEnv | None = None
    try:
        dev = ensure_dev_material(root / "dev")
        await postgres.start()
        settings = service_settings(root, dev, postgres)
        await migrate(await Database.locate(settings), settings)
        env = BenchEnv(root, dev, postgres, settings)
        yield env
    finally:
        if env is not None:
            await env.stop_service()
        await postgres.stop()
        shutil.rmtree(pg_state, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
