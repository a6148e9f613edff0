"""The mTLS gRPC server: who gets in, what they get, and how errors look on the wire."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import failure_of, mtls_channel, role_channel
from tokensvc.app import Service
from tokensvc.auth.devpki import (
    DevPaths,
    issue_client_certificate,
    make_ca,
    make_certificate,
    pem_cert,
    pem_key,
)
from tokensvc.v1 import admin_pb2, admin_pb2_grpc


async def check_health(channel: grpc.aio.Channel) -> int:
    async with channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        return int(response.status)


def ca_signed_client(dev: DevPaths, uris: list[str]) -> tuple[bytes, bytes]:
    """A client certificate from the dev CA with the given URI SANs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate(dev.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(dev.ca_key.read_bytes(), password=None)
    cert, key = make_certificate(
        issuer_cert=ca_cert, issuer_key=ca_key, subject_cn="test-client", uri_sans=uris, client=True
    )
    return pem_cert(cert), pem_key(key)


async def test_health_is_serving_over_mtls(service: Service, dev: DevPaths) -> None:
    status = await check_health(role_channel(service.port, dev, "launcher"))
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_client_without_a_certificate_fails_the_handshake(service: Service, dev: DevPaths) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check_health(mtls_channel(service.port, dev.ca_cert))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_certificate_from_another_ca_fails_the_handshake(
    service: Service, dev: DevPaths
) -> None:
    other_ca, other_key = make_ca("other CA")
    cert, key = make_certificate(
        issuer_cert=other_ca,
        issuer_key=other_key,
        subject_cn="impostor",
        uri_sans=["spiffe://dev.local/ns/default/sa/dev-agent"],
        client=True,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check_health(mtls_channel(service.port, dev.ca_cert, pem_cert(cert), pem_key(key)))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_is_refused(service: Service) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check_health(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "uris",
    [
        [],
        ["https://dev.local/not-spiffe"],
        ["spiffe://dev.local/ns/a/sa/b", "spiffe://dev.local/ns/c/sa/d"],
        ["spiffe://other.domain/ns/default/sa/dev-agent"],
    ],
    ids=["no-uri-san", "non-spiffe-uri", "two-spiffe-ids", "foreign-trust-domain"],
)
async def test_certificate_without_exactly_one_spiffe_id_of_our_domain_is_refused(
    service: Service, dev: DevPaths, uris: list[str]
) -> None:
    cert, key = ca_signed_client(dev, uris)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check_health(mtls_channel(service.port, dev.ca_cert, cert, key))
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.UNAUTHENTICATED
    assert failure.reason == "CALLER_IDENTITY_INVALID"


async def test_common_name_is_never_trusted_as_identity(service: Service, dev: DevPaths) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate(dev.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(dev.ca_key.read_bytes(), password=None)
    cert, key = make_certificate(
        issuer_cert=ca_cert,
        issuer_key=ca_key,
        subject_cn="spiffe://dev.local/admin/platform-admin",
        uri_sans=["spiffe://dev.local/ns/default/sa/someone"],
        client=True,
    )
    async with mtls_channel(service.port, dev.ca_cert, pem_cert(cert), pem_key(key)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin_pb2_grpc.AdminServiceStub(channel).GetCredentialStatus(
                admin_pb2.GetCredentialStatusRequest(), timeout=10
            )
    assert failure_of(caught.value).reason == "ROLE_NOT_ALLOWED"


async def test_launcher_calling_an_admin_rpc_is_permission_denied(service: Service, dev: DevPaths) -> None:
    async with role_channel(service.port, dev, "launcher") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin_pb2_grpc.AdminServiceStub(channel).GetCredentialStatus(
                admin_pb2.GetCredentialStatusRequest(), timeout=10
            )
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.PERMISSION_DENIED
    assert failure.reason == "ROLE_NOT_ALLOWED"
    assert "admin" not in failure.message.lower()


async def test_unknown_rpc_answers_unimplemented_with_an_error_info_reason(
    service: Service, dev: DevPaths
) -> None:
    async with role_channel(service.port, dev, "admin") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/tokensvc.v1.AdminService/NoSuchMethod")(b"", timeout=10)
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.UNIMPLEMENTED
    assert failure.reason == "NOT_IMPLEMENTED"
    assert failure.metadata["request_id"]


async def test_request_id_from_the_caller_is_echoed_in_error_info(service: Service, dev: DevPaths) -> None:
    async with role_channel(service.port, dev, "launcher") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin_pb2_grpc.AdminServiceStub(channel).GetCredentialStatus(
                admin_pb2.GetCredentialStatusRequest(),
                timeout=10,
                metadata=(("x-request-id", "req-123"),),
            )
    assert failure_of(caught.value).metadata["request_id"] == "req-123"


async def test_reflection_is_off_unless_enabled(start_service, dev: DevPaths) -> None:  # type: ignore[no-untyped-def]
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def list_services(port: int) -> list[str]:
        async with role_channel(port, dev, "launcher") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for response in stub.ServerReflectionInfo(iter([request]), timeout=10):
                return [s.name for s in response.list_services_response.service]
        return []

    plain = await start_service()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await list_services(plain.port)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED

    reflective = await start_service(reflection=True)
    names = await list_services(reflective.port)
    assert "tokensvc.v1.MemoryService" in names
    assert "grpc.health.v1.Health" in names


async def test_service_serves_as_a_role_that_is_neither_superuser_nor_owner(service: Service) -> None:
    assert service.database is not None
    async with service.database.pool.acquire() as conn:
        user = await conn.fetchval("SELECT current_user")
        superuser = await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        owned = await conn.fetchval(
            """SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
               WHERE r.rolname = current_user"""
        )
        schema_owner = await conn.fetchval(
            "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'tokensvc'"
        )
    assert not superuser
    assert owned == 0
    assert schema_owner != user


async def test_stopping_flips_health_to_not_serving_before_the_port_closes(
    start_service, dev: DevPaths
) -> None:  # type: ignore[no-untyped-def]
    service = await start_service()
    await service.health.enter_graceful_shutdown()
    status = await check_health(role_channel(service.port, dev, "launcher"))
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_an_unknown_method_from_a_peer_of_another_trust_domain_is_unauthenticated(
    service: Service, dev: DevPaths, tmp_path: Path
) -> None:
    cert, key = issue_client_certificate(
        dev, "spiffe://other.example/ns/default/sa/dev-agent", tmp_path, "other"
    )
    async with mtls_channel(service.port, dev.ca_cert, cert, key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary("/tokensvc.v1.AdminService/NoSuchMethod")(b"", timeout=10)
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.UNAUTHENTICATED
    assert failure.reason == "CALLER_IDENTITY_INVALID"


async def test_a_huge_unknown_method_name_is_not_echoed_whole(service: Service, dev: DevPaths) -> None:
    method = "/tokensvc.v1.AdminService/" + "x" * 16_000
    async with role_channel(service.port, dev, "admin") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(method)(b"", timeout=10)
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.UNIMPLEMENTED
    assert len(failure.message) < 400
