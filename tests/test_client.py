"""tokensvc.client against a live server: typed errors, retries, certificate rotation."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import shutil
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.support import dev_capability, free_port
from tokensvc.auth.devpki import LAUNCHER_SPIFFE_ID, DevPaths, issue_client_certificate
from tokensvc.client import CallFailed, TokensvcClient


def capability(dev: DevPaths, **claims: object) -> str:
    return dev_capability(dev, **{"long_term_memory": True, **claims})


def launcher_client(port: int, dev: DevPaths, token: str | None, **options: object) -> TokensvcClient:
    cert, key = dev.client("launcher")
    return TokensvcClient(f"127.0.0.1:{port}", dev.ca_cert, cert, key, capability=token, **options)  # type: ignore[arg-type]


async def test_typed_results_and_errors_carry_the_error_info_reason(service, dev: DevPaths) -> None:  # type: ignore[no-untyped-def]
    async with launcher_client(service.port, dev, capability(dev)) as client:
        scope = await client.verify_capability()
        assert (scope.namespace, scope.agent) == ("default", "dev-agent")
        results = await client.remember(["client fact about otters"])
        hits = await client.search_memories("otters", top_k=3)
        assert results[0].id in {hit.memory.id for hit in hits}
        with pytest.raises(CallFailed) as caught:
            await client.derive_session_key("bad/id")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "INVALID_ARGUMENT"
    assert caught.value.field == "conversation_id"

    async with launcher_client(service.port, dev, capability(dev, agent="someone-else")) as client:
        with pytest.raises(CallFailed) as caught:
            await client.verify_capability()
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.reason == "BINDING_MISMATCH"


async def test_idempotent_calls_are_retried_until_the_server_comes_up(start_service, dev: DevPaths) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    client = launcher_client(port, dev, capability(dev), max_attempts=8, backoff=0.2, max_backoff=1.0)

    async def start_later() -> None:
        await asyncio.sleep(0.5)
        await start_service(listen_address=f"127.0.0.1:{port}")

    async with client:
        started = asyncio.create_task(start_later())
        scope = await client.verify_capability()  # UNAVAILABLE at first, then served
        await started
    assert scope.agent == "dev-agent"


async def test_writes_are_not_retried(dev: DevPaths) -> None:
    async with launcher_client(free_port(), dev, capability(dev), max_attempts=5, backoff=2.0) as client:
        started = time.monotonic()
        with pytest.raises(CallFailed) as caught:
            await client.remember(["no idempotency key, so no retry"])
        elapsed = time.monotonic() - started
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert elapsed < 2.0  # one attempt: the 2 s backoff never happened (a bound, not a benchmark)


async def test_a_rotated_client_certificate_is_picked_up_without_a_new_client(
    service,
    dev: DevPaths,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    cert_file, key_file = tmp_path / "launcher.crt", tmp_path / "launcher.key"
    shutil.copy(dev.client("launcher")[0], cert_file)
    shutil.copy(dev.client("launcher")[1], key_file)
    rotated_cert, rotated_key = issue_client_certificate(
        dev, LAUNCHER_SPIFFE_ID, tmp_path / "next", "launcher"
    )
    der = x509.load_pem_x509_certificate(rotated_cert.read_bytes()).public_bytes(Encoding.DER)
    thumbprint = base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()
    bound = capability(dev, cnf_x5t_s256=thumbprint)  # only the rotated certificate may use it

    client = TokensvcClient(
        f"127.0.0.1:{service.port}", dev.ca_cert, cert_file, key_file, capability=bound, check_interval=0.0
    )
    async with client:
        with pytest.raises(CallFailed) as caught:
            await client.verify_capability()
        assert caught.value.reason == "BINDING_MISMATCH"
        shutil.copy(rotated_key, key_file)
        shutil.copy(rotated_cert, cert_file)
        scope = await client.verify_capability()
    assert scope.agent == "dev-agent"


def test_the_former_name_tokensvc_error_still_catches_failed_calls_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match="CallFailed"):
        from tokensvc.client import TokensvcError  # type: ignore[attr-defined]
    assert TokensvcError is CallFailed
    with pytest.raises(ImportError):
        from tokensvc.client import NoSuchName  # type: ignore[attr-defined] # noqa: F401
