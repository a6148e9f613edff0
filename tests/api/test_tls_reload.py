"""Server certificates reload from their files without a restart; bad files change nothing."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import role_channel
from tokensvc.auth.devpki import DevPaths, make_certificate, pem_cert, pem_key

RELOAD_WAIT = 1.3  # the files are checked at most once a second


def new_server_certificate(dev: DevPaths, common_name: str) -> tuple[bytes, bytes]:
    ca_cert = x509.load_pem_x509_certificate(dev.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(dev.ca_key.read_bytes(), password=None)
    cert, key = make_certificate(
        issuer_cert=ca_cert,
        issuer_key=ca_key,
        subject_cn=common_name,
        dns_sans=["localhost"],
        ip_sans=["127.0.0.1"],
        server=True,
    )
    return pem_cert(cert), pem_key(key)


def presented_certificate(port: int, dev: DevPaths) -> bytes:
    """The SHA-256 of the certificate a brand-new TLS connection is shown."""
    context = ssl.create_default_context(cafile=str(dev.ca_cert))
    cert, key = dev.client("launcher")
    context.load_cert_chain(str(cert), str(key))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).digest()


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


async def serving(port: int, dev: DevPaths) -> bool:
    async with role_channel(port, dev, "launcher") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return response.status == health_pb2.HealthCheckResponse.SERVING


async def test_swapped_certificate_reaches_new_connections_and_bad_files_change_nothing(
    start_service,
    dev: DevPaths,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    cert_file, key_file, ca_file = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    shutil.copy(dev.server_cert, cert_file)
    shutil.copy(dev.server_key, key_file)
    shutil.copy(dev.ca_cert, ca_file)
    service = await start_service(
        tls_cert_file=str(cert_file), tls_key_file=str(key_file), tls_client_ca_file=str(ca_file)
    )
    original = await asyncio.to_thread(presented_certificate, service.port, dev)

    fresh_cert, fresh_key = new_server_certificate(dev, "tokensvc rotated")
    write_atomically(key_file, fresh_key)
    write_atomically(cert_file, fresh_cert)
    await asyncio.sleep(RELOAD_WAIT)
    rotated = await asyncio.to_thread(presented_certificate, service.port, dev)
    expected = hashlib.sha256(
        x509.load_pem_x509_certificate(fresh_cert).public_bytes(serialization.Encoding.DER)
    ).digest()
    assert rotated != original
    assert rotated == expected
    assert await serving(service.port, dev)

    # A half-written certificate, then a key that does not match: the rotated pair stays in force.
    write_atomically(cert_file, fresh_cert[: len(fresh_cert) // 2])
    await asyncio.sleep(RELOAD_WAIT)
    assert await asyncio.to_thread(presented_certificate, service.port, dev) == expected
    _, other_key = new_server_certificate(dev, "mismatch")
    write_atomically(cert_file, fresh_cert)
    write_atomically(key_file, other_key)
    await asyncio.sleep(RELOAD_WAIT)
    assert await asyncio.to_thread(presented_certificate, service.port, dev) == expected
    assert await serving(service.port, dev)
    assert service.tls is not None
    assert service.tls.reloads == 1
