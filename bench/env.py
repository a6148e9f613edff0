"""A throwaway world to measure in: embedded PostgreSQL, dev PKI, an in-process tokensvc over mTLS.

Everything lives in temporary directories that are removed at the end. The PostgreSQL server is the
same embedded PostgreSQL 18 + pgvector the tests use, migrated by the schema owner; the service is
`tokensvc.app.Service` configured the production way (DSN + credential directories), serving mTLS
gRPC on a free port of 127.0.0.1 — or, from `start_server_process`, `tokensvc serve [--workers N]`
as a child process with the same settings in a TOML file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from tokensvc.app import Service, locate_database, migrate
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
from tokensvc.settings import Settings
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres import EmbeddedPaths, EmbeddedPostgres

__all__ = ["BenchEnv", "ServerProcess", "bench_env", "config_toml", "connect_as", "free_port", "settings_for"]

ROOT = Path(__file__).resolve().parent.parent

NAMESPACE = "default"
AGENT = "dev-agent"  # the dev launcher certificate's workload: spiffe://dev.local/ns/default/sa/dev-agent


@dataclass
class BenchEnv:
    root: Path
    dev: DevPaths
    postgres: EmbeddedPostgres
    settings: Settings
    service: Service | None = None
    process: ServerProcess | None = None
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
        if self.process is not None:
            self.process.stop()
            self.process = None

    async def start_server_process(
        self, workers: int = 1, *, tree: Path = ROOT, log_name: str = "server", **overrides: Any
    ) -> ServerProcess:
        """(Re)start tokensvc as `tokensvc serve --workers N` from source `tree`, logging at INFO
        to `<root>/<log_name>.log`, serving when this returns (every worker, when N > 1)."""
        await self.stop_service()
        values = {"listen_address": f"127.0.0.1:{free_port()}", "log_level": "INFO", **overrides}
        self.settings = service_settings(self.root, self.dev, self.postgres, **values)
        self.process = ServerProcess(self.settings, workers, self.root / f"{log_name}.log", tree)
        await self.process.wait_serving()
        return self.process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_toml(settings: Settings) -> str:
    """`settings` as a TOML config file for `tokensvc serve --config`: the values that differ
    from the defaults (so an older tree, without a newer setting, reads it too)."""
    lines = []
    for item in dataclasses.fields(settings):
        value = getattr(settings, item.name)
        factory = item.default_factory
        default = factory() if factory is not dataclasses.MISSING else item.default
        if value is None or value == default:
            continue
        if isinstance(value, tuple):
            text = json.dumps([str(v) for v in value])
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        lines.append(f"{item.name} = {text}")
    return "\n".join(lines) + "\n"


class ServerProcess:
    """`tokensvc serve --config FILE [--workers N]` as a child process, its stderr in a file."""

    def __init__(self, settings: Settings, workers: int, log_file: Path, tree: Path = ROOT) -> None:
        self.port = int(settings.listen_address.rpartition(":")[2])
        self.workers = workers
        self.log_file = log_file
        config = log_file.with_suffix(".toml")
        config.write_text(config_toml(settings))
        command = [sys.executable, "-m", "tokensvc", "serve", "--config", str(config)]
        if workers != 1:
            command += ["--workers", str(workers)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSVC_")}
        env["PYTHONPATH"] = str(tree)
        with log_file.open("w") as stderr:
            self.process = subprocess.Popen(
                command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=stderr
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait_serving(self, deadline_s: float = 120) -> None:
        """Until the log says every process serves (a single server's or the parent's "serving")."""
        began = time.monotonic()
        while time.monotonic() - began < deadline_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokensvc exited with {self.process.returncode}; see {self.log_file}")
            for line in self.log_file.read_text().splitlines():
                if line.startswith("{") and '"msg": "serving"' in line:
                    entry = json.loads(line)
                    # An older tree logs no pid: its one process's line is the one.
                    if entry.get("pid", self.pid) == self.pid:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"tokensvc did not serve within {deadline_s} s; see {self.log_file}")

    def stop(self) -> int:
        """SIGTERM, then wait (SIGKILL after 60 s); the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def service_settings(root: Path, dev: DevPaths, postgres: EmbeddedPostgres, **overrides: Any) -> Settings:
    return settings_for(postgres.dsn(), postgres.paths, root, dev, **overrides)


def settings_for(dsn: str, paths: EmbeddedPaths, root: Path, dev: DevPaths, **overrides: Any) -> Settings:
    """Settings for a tokensvc on the database at `dsn`, logging in with the credentials under
    `paths`, with the dev PKI and its state under `root`."""
    values: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "state_dir": str(root / "state"),
        "database_dsn": dsn,
        "database_credential_dir": str(paths.credential_dir("app")),
        "database_owner_credential_dir": str(paths.credential_dir("owner")),
        "database_rotator_credential_dir": str(paths.credential_dir("rotator")),
        # The background runners' own credential (re-embedding, ingestion: migration 0021).
        "database_runner_credential_dir": str(paths.credential_dir("runner")),
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
        await migrate(await locate_database(settings), settings)
        env = BenchEnv(root, dev, postgres, settings)
        yield env
    finally:
        if env is not None:
            await env.stop_service()
        await postgres.stop()
        shutil.rmtree(pg_state, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
