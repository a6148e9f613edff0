"""Shared helpers for tests: settings for a service on the shared database, mTLS channels."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokensvc.auth.capabilities import mint_capability
from tokensvc.auth.devpki import (
    ADMIN_SPIFFE_ID,
    CONTROL_PLANE_SPIFFE_ID,
    DEV_TRUST_DOMAIN,
    DevPaths,
    load_signing_key,
)
from tokensvc.settings import Settings, load_settings
from tokensvc.storage.postgres import EmbeddedPostgres


@dataclass(frozen=True)
class SharedDatabase:
    """The session's embedded PostgreSQL, reached the production way: DSN + credential dirs."""

    server: EmbeddedPostgres

    @property
    def dsn(self) -> str:
        return self.server.dsn()

    @property
    def app_credential_dir(self) -> Path:
        return self.server.paths.credential_dir("app")

    @property
    def owner_credential_dir(self) -> Path:
        return self.server.paths.credential_dir("owner")

    @property
    def rotator_credential_dir(self) -> Path:
        return self.server.paths.credential_dir("rotator")

    @property
    def superuser_credential_dir(self) -> Path:
        return self.server.paths.credential_dir("superuser")


def service_settings(database: SharedDatabase, dev: DevPaths, state_dir: Path, **overrides: Any) -> Settings:
    """Settings for a tokensvc on the shared database with the dev PKI, on a free port."""
    values: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "state_dir": str(state_dir),
        "database_dsn": database.dsn,
        "database_credential_dir": str(database.app_credential_dir),
        "database_owner_credential_dir": str(database.owner_credential_dir),
        "database_rotator_credential_dir": str(database.rotator_credential_dir),
        "tls_cert_file": str(dev.server_cert),
        "tls_key_file": str(dev.server_key),
        "tls_client_ca_file": str(dev.ca_cert),
        "trust_domain": DEV_TRUST_DOMAIN,
        "admin_spiffe_ids": [ADMIN_SPIFFE_ID],
        "control_plane_spiffe_ids": [CONTROL_PLANE_SPIFFE_ID],
        "trust_bundle_file": str(dev.trust_bundle),
        "pepper_dir": str(dev.pepper_dir),
        "signing_key_file": str(dev.signing_key),
        "shutdown_grace_seconds": 5.0,
        # Tests that need meaning choose the embedded model (multilingual-e5-small) explicitly;
        # the rest use `hash`, which is instant and deterministic.
        "memory_embedder": "hash",
    }
    values.update(overrides)
    return load_settings(environ={}, overrides=values)


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dev_capability(dev: DevPaths, **claims: Any) -> str:
    """A capability signed with the dev key, for namespace `default` / agent `dev-agent` unless
    `claims` (mint_capability's keyword arguments) say otherwise."""
    kid, key = load_signing_key(dev.signing_key)
    values: dict[str, Any] = {"namespace": "default", "agent": "dev-agent", **claims}
    return mint_capability(
        key, kid, issuer="ctxmesh-control-plane", audience="tokensvc", now=time.time(), **values
    )


def mtls_channel(
    port: int,
    ca: Path | bytes,
    cert: Path | bytes | None = None,
    key: Path | bytes | None = None,
) -> grpc.aio.Channel:
    def read(value: Path | bytes | None) -> bytes | None:
        return value.read_bytes() if isinstance(value, Path) else value

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)


def role_channel(port: int, dev: DevPaths, role: str) -> grpc.aio.Channel:
    cert, key = dev.client(role)
    return mtls_channel(port, dev.ca_cert, cert, key)


@dataclass(frozen=True)
class RpcFailure:
    code: grpc.StatusCode
    message: str
    reason: str | None
    metadata: Mapping[str, str]
    field_violations: list[str]


def failure_of(error: grpc.aio.AioRpcError) -> RpcFailure:
    """Decode a failed call's status: code, message, ErrorInfo reason, BadRequest fields."""
    reason = None
    metadata: dict[str, str] = {}
    fields: list[str] = []
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                fields = [violation.field for violation in bad.field_violations]
    return RpcFailure(error.code(), error.details() or "", reason, metadata, fields)
