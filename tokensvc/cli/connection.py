"""Client connection flags shared by every client command, and the mTLS channel they build.

Explicit `--ca/--cert/--key` win over `--state-dir`; with only a state dir, each command picks
the dev certificate of the role it needs (launcher, admin or control plane).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tokensvc.auth.devpki import DevPaths
from tokensvc.client import CallFailed, TokensvcClient

__all__ = [
    "ClientFiles",
    "RpcFailed",
    "add_connection_flags",
    "call_service",
    "client_files",
    "client_for",
    "open_channel",
]

DEFAULT_TARGET = "127.0.0.1:50051"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        default=os.environ.get("TOKENSVC_TARGET", DEFAULT_TARGET),
        help=f"host:port of tokensvc (default {DEFAULT_TARGET}, or $TOKENSVC_TARGET)",
    )
    group.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="take the CA and the role's certificate from a `tokensvc dev` state dir",
    )
    for flag, what in (
        ("ca", "CA bundle the server certificate chains to"),
        ("cert", "client certificate (PEM)"),
        ("key", "client private key (PEM)"),
    ):
        variable = f"TOKENSVC_{flag.upper()}"
        default = os.environ.get(variable)
        group.add_argument(
            f"--{flag}",
            type=Path,
            default=Path(default) if default else None,
            help=f"{what} (or ${variable})",
        )
    group.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds (default 10)")


@dataclass(frozen=True)
class ClientFiles:
    ca: Path
    cert: Path
    key: Path


class ConnectionError_(ValueError):
    """Missing or unreadable connection flags."""


def client_files(args: argparse.Namespace, role: str = "launcher") -> ClientFiles:
    """Resolve CA, certificate and key from explicit flags, else from the dev state dir."""
    state_dir: Path | None = args.state_dir
    if state_dir is None and not (args.ca and args.cert and args.key):
        default = Path(".tokensvc-dev")
        state_dir = default if default.is_dir() else None
    dev = DevPaths.for_state_dir(state_dir) if state_dir is not None else None
    ca = args.ca or (dev.ca_cert if dev else None)
    cert, key = args.cert, args.key
    if dev is not None:
        dev_cert, dev_key = dev.client(role)
        cert = cert or dev_cert
        key = key or dev_key
    missing = [flag for flag, value in (("--ca", ca), ("--cert", cert), ("--key", key)) if value is None]
    if missing:
        raise ConnectionError_(
            f"{', '.join(missing)} required (or --state-dir of a `tokensvc dev` state dir)"
        )
    assert ca is not None
    assert cert is not None
    assert key is not None
    for flag, path in (("--ca", ca), ("--cert", cert), ("--key", key)):
        if not path.is_file():
            raise ConnectionError_(f"{flag}: {path} does not exist")
    return ClientFiles(ca, cert, key)


def open_channel(target: str, files: ClientFiles) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes(),
        private_key=files.key.read_bytes(),
        certificate_chain=files.cert.read_bytes(),
    )
    return grpc.aio.secure_channel(target, credentials)


class RpcFailed(Exception):
    """A call failed; the message carries the status code and the ErrorInfo reason."""


def client_for(args: argparse.Namespace, role: str, capability: str | None = None) -> TokensvcClient:
    files = client_files(args, role=role)
    return TokensvcClient(
        args.target, files.ca, files.cert, files.key, capability=capability, timeout=args.timeout
    )


def call_service(
    args: argparse.Namespace,
    role: str,
    service: str,
    method: str,
    request: Any,
    capability: str | None = None,
) -> Any:
    """One call through the Python client, as a plain function for the CLI."""

    async def call() -> Any:
        async with client_for(args, role, capability) as client:
            return await client.call(service, method, request, capability=capability is not None)

    try:
        return asyncio.run(call())
    except CallFailed as exc:
        raise RpcFailed(str(exc)) from None
