"""Shared helpers for tests: settings for a service on the shared database, database connections
beneath row-level security, capabilities signed with the dev key, mTLS channels, decoded statuses.

Every test outside tests/storage takes these from here rather than keeping its own copy.
"""

from __future__ import annotations

import base64
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from pgvector.asyncpg import register_vector

from tokensvc.auth.capabilities import CAPABILITY_TYPE, mint_capability
from tokensvc.auth.devpki import (
    ADMIN_SPIFFE_ID,
    CONTROL_PLANE_SPIFFE_ID,
    DEV_TRUST_DOMAIN,
    DevPaths,
    load_signing_key,
)
from tokensvc.credentials import FileCredentialSource
from tokensvc.settings import Settings
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres import EmbeddedPostgres
from tokensvc.v1 import admin_pb2, admin_pb2_grpc

# The `iss` and `aud` a service started by `service_settings` accepts (the settings' defaults).
ISSUER = "ctxmesh-control-plane"
AUDIENCE = "tokensvc"


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
    def runner_credential_dir(self) -> Path:
        return self.server.paths.credential_dir("runner")

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
        "database_runner_credential_dir": str(database.runner_credential_dir),
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


# --- the database, beneath row-level security -------------------------------------------------


@asynccontextmanager
async def connect_as(
    credential_dir: Path, dsn: str | None = None, **connect: Any
) -> AsyncIterator[asyncpg.Connection]:
    """A connection as the login role whose secret `credential_dir` holds, closed afterwards.

    `search_path` is `tokensvc, public` and pgvector's codec is registered (an embedding reads as
    a `Vector`). `dsn` or asyncpg's own keywords (`host`, `port`, `database`...) say where.
    """
    credential = FileCredentialSource(credential_dir).read()
    conn = await asyncpg.connect(
        dsn,
        user=credential.username,
        password=credential.password,
        server_settings={"search_path": "tokensvc, public"},
        **connect,
    )
    try:
        await register_vector(conn, schema="public")
        yield conn
    finally:
        await conn.close()


def superuser(database: SharedDatabase) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """The database as its superuser: every tenant's rows, no row-level security."""
    return connect_as(database.superuser_credential_dir, database.dsn)


# --- capabilities signed with the dev key -----------------------------------------------------


def dev_capability(dev: DevPaths, **claims: Any) -> str:
    """A capability signed with the dev key, for namespace `default` / agent `dev-agent` unless
    `claims` (mint_capability's keyword arguments) say otherwise."""
    kid, key = load_signing_key(dev.signing_key)
    values: dict[str, Any] = {"namespace": "default", "agent": "dev-agent", **claims}
    return mint_capability(key, kid, issuer=ISSUER, audience=AUDIENCE, now=time.time(), **values)


def b64url(data: bytes) -> str:
    """Unpadded base64url, as JWS segments and tokensvc's page tokens are written."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def json_parsed(monkeypatch: Any) -> list[str]:
    """Every document the json module parses from now on (json.loads and every JSONDecoder), to
    show that a decoder refused something before parsing it. `monkeypatch`: pytest's fixture."""
    parsed: list[str] = []
    decode = json.JSONDecoder.decode

    def spy(self: json.JSONDecoder, document: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(document)
        return decode(self, document, *args, **kwargs)

    monkeypatch.setattr(json.JSONDecoder, "decode", spy)
    return parsed


def segment(value: Any) -> str:
    """A JWS segment: base64url of `value` (bytes as they are, anything else as JSON)."""
    return b64url(value if isinstance(value, bytes) else json.dumps(value).encode())


def launcher_claims(**overrides: Any) -> dict[str, Any]:
    """The documented claims of a capability for the dev launcher (`default` / `dev-agent`), valid
    for ten minutes, with a fresh run id and jti each time; `overrides` replace or add claims."""
    iat = int(time.time())
    return {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": f"run-{uuid.uuid4()}",
        "jti": uuid.uuid4().hex,
        "iat": iat,
        "nbf": iat,
        "exp": iat + 600,
        "ns": "default",
        "agent": "dev-agent",
        "per_user": False,
        "ltm": False,
        "kbs": [],
        **overrides,
    }


@dataclass(frozen=True)
class Signer:
    """Signs anything with an Ed25519 key: capabilities no minting helper would make, for attacks.

    `mint_capability` refuses values the verifier would refuse; a Signer signs them anyway, so
    the verifier's own checks are what a test sees.
    """

    kid: str
    key: Ed25519PrivateKey

    @classmethod
    def dev(cls, dev: DevPaths) -> Signer:
        """The dev control plane's key, which the test services trust."""
        return cls(*load_signing_key(dev.signing_key))

    def header(self, **extra: Any) -> dict[str, Any]:
        return {"alg": "EdDSA", "typ": CAPABILITY_TYPE, "kid": self.kid, **extra}

    def token(self, **overrides: Any) -> str:
        """`launcher_claims(**overrides)` signed by plain PyJWT, as any control plane would."""
        headers = {"typ": CAPABILITY_TYPE, "kid": self.kid}
        return jwt.encode(launcher_claims(**overrides), self.key, algorithm="EdDSA", headers=headers)

    def sign_segments(self, header_segment: str, payload_segment: str) -> str:
        """A compact JWS over arbitrary segment text, with a genuine signature by this key."""
        signing_input = f"{header_segment}.{payload_segment}"
        return f"{signing_input}.{b64url(self.key.sign(signing_input.encode()))}"

    def sign(self, header: Any, payload: Any) -> str:
        """A compact JWS of any header and payload (JSON values or raw bytes)."""
        return self.sign_segments(segment(header), segment(payload))


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting `token` as the run capability."""
    return (("authorization", f"Bearer {token}"),)


# --- calls ------------------------------------------------------------------------------------


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


async def audit_events(port: int, dev: DevPaths, kind: int, target: str) -> list[Any]:
    """The audit events of `kind` (an AuditEventKind value) whose target names `target`, newest
    first, as an admin lists them."""
    async with role_channel(port, dev, "admin") as channel:
        page = await admin_pb2_grpc.AdminServiceStub(channel).ListAuditEvents(
            admin_pb2.ListAuditEventsRequest(kinds=[kind], page_size=500), timeout=30
        )
    return [event for event in page.events if target in event.target]


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
