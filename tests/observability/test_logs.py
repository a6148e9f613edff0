"""Structured logs: every RPC is one JSON line with its request id, method, caller, status and
duration, and a full run of every RPC family logs no secret, token, content or raw user id.

The run uses its own embedded PostgreSQL, because it rotates the database credentials (a new
password that must not be logged either) and that changes the secret files.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from tests.api.knowledge_support import eq, open_clients
from tests.api.memory_support import Launchers
from tests.support import SharedDatabase, role_channel, service_settings
from tokensvc.app import Service, locate_database, migrate
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.logs import JsonFormatter
from tokensvc.storage.postgres import EmbeddedPostgres
from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    knowledge_pb2,
    memory_pb2,
)

USER_ID = "loguser-9f3c1d-canary@example.org"
ISSUED_USER_ID = "issued-user-77aa05-canary"
CONTENT = "the canary memory says the vault code is aubergine-271828"
UPDATED = "the canary memory now says the vault code is quince-161803"
QUERY = "which vault code did the canary aubergine memory mention"
DOCUMENT = "# Canary handbook\n\nThe lighthouse keeper's secret phrase is marmalade-zephyr-5772.\n"
BAD_TOKEN = "eyJhbGciOiJFZERTQSJ9.canary-garbage-token-0f9e8d.c2lnbmF0dXJl"
RPC_FIELDS = ("request_id", "method", "caller", "status", "duration_ms")


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Collect]:
    """Every log record of every logger, at DEBUG, while the test runs."""
    handler = Collect()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
async def own_database() -> AsyncIterator[SharedDatabase]:
    # Outside pytest's basetemp (see tests/conftest.py `database`).
    directory = Path(tempfile.mkdtemp(prefix="tokensvc-logs-"))
    server = EmbeddedPostgres(directory)
    try:
        await server.start()
        yield SharedDatabase(server)
    finally:
        await server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def passwords(database: SharedDatabase) -> list[str]:
    dirs = (
        database.app_credential_dir,
        database.owner_credential_dir,
        database.rotator_credential_dir,
        database.superuser_credential_dir,
    )
    return [FileCredentialSource(directory).read().password for directory in dirs]


def key_material(dev: DevPaths) -> list[str]:
    """The signing key's private `d` and every pepper, as text and in the encodings a log might use."""
    found = [json.loads(dev.signing_key.read_text())["d"]]
    for pepper_file in dev.pepper_dir.iterdir():
        text = pepper_file.read_text().strip()
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        found += [text, raw.hex(), base64.b64encode(raw).decode().rstrip("="), repr(raw)[2:-1]]
    return found


async def full_run(service: Service, dev: DevPaths, database: SharedDatabase, tmp_path: Path) -> list[str]:
    """Every RPC family, successes and refusals; returns the secrets that came into being."""
    new_secrets: list[str] = []
    launchers = Launchers(service, dev, tmp_path / "launchers")
    try:
        caller = launchers.caller(user=USER_ID, per_user=True)
        new_secrets.append(caller.token)
        memory_id = (await caller.remember(CONTENT))[0]
        await caller.search(QUERY)
        await caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=memory_id))
        await caller.list_all()
        await caller.call("UpdateMemory", memory_pb2.UpdateMemoryRequest(id=memory_id, content=UPDATED))
        await caller.fail("Remember", memory_pb2.RememberRequest(items=[memory_pb2.RememberItem()]))
        await caller.fail("GetMemory", memory_pb2.GetMemoryRequest(id=CONTENT))
        await caller.call("Forget", memory_pb2.ForgetRequest(ids=[memory_id]))
        await caller.call("ForgetAll", memory_pb2.ForgetAllRequest())
        capability = capability_pb2_grpc.CapabilityServiceStub(caller.channel)
        await capability.VerifyCapability(
            capability_pb2.VerifyCapabilityRequest(), metadata=caller.metadata, timeout=20
        )
        await capability.DeriveSessionKey(
            capability_pb2.DeriveSessionKeyRequest(conversation_id="conv-1"),
            metadata=caller.metadata,
            timeout=20,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await capability.VerifyCapability(
                capability_pb2.VerifyCapabilityRequest(),
                metadata=(("authorization", f"Bearer {BAD_TOKEN}"),),
                timeout=20,
            )
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # Another agent's launcher presenting this capability: a binding refusal.
        other = launchers.caller()
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:
            await other.memory.Remember(
                memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=CONTENT)]),
                metadata=caller.metadata,
                timeout=20,
            )
        assert mismatch.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await launchers.aclose()

    async with open_clients(service, dev) as clients:
        control = capability_pb2_grpc.CapabilityServiceStub(clients.channel("control-plane"))
        issued = await control.IssueCapability(
            capability_pb2.IssueCapabilityRequest(
                namespace="default",
                agent="dev-agent",
                user=ISSUED_USER_ID,
                per_user=True,
                long_term_memory=True,
            ),
            timeout=20,
        )
        new_secrets.append(issued.token)
        await control.RevokeCapability(capability_pb2.RevokeCapabilityRequest(jti=issued.jti), timeout=20)

        manager = clients.manager()
        kb = "kb-logs"
        await manager.create(kb)
        await manager.upload(kb, "handbook.md", DOCUMENT, metadata={"owner": USER_ID})
        await manager.get(kb)
        await manager.list_bases(10)
        await manager.get_document(kb, "handbook.md")
        await manager.list_documents(kb, 10, filter_=eq("owner", "nobody"))
        searcher = clients.searcher([kb])
        new_secrets.append(searcher.token)
        await searcher.search("lighthouse keeper secret phrase", [kb])
        with pytest.raises(grpc.aio.AioRpcError):
            await searcher.search(QUERY, ["kb-not-granted"])
        await manager.delete_document(kb, "handbook.md")
        await manager.delete(kb)
        with pytest.raises(grpc.aio.AioRpcError):
            await manager.stub.UploadDocument(
                iter([knowledge_pb2.UploadDocumentRequest(content=DOCUMENT.encode())]), timeout=20
            )

    admin_channel = role_channel(service.port, dev, "admin")
    try:
        admin = admin_pb2_grpc.AdminServiceStub(admin_channel)
        await admin.GetCredentialStatus(admin_pb2.GetCredentialStatusRequest(), timeout=30)
        await admin.ReloadTrustBundle(admin_pb2.ReloadTrustBundleRequest(), timeout=30)
        await admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(page_size=50), timeout=30)
        await admin.RotateDatabaseCredentials(
            admin_pb2.RotateDatabaseCredentialsRequest(mode=admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE),
            timeout=60,
        )
        await admin.RotateDatabaseCredentials(
            admin_pb2.RotateDatabaseCredentialsRequest(mode=admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD),
            timeout=60,
        )
    finally:
        await admin_channel.close(grace=None)
    return new_secrets


async def test_a_full_run_logs_every_rpc_and_no_secret(
    captured: Collect, own_database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    settings = service_settings(own_database, dev, tmp_path, migrate_on_start=False)
    await migrate(await locate_database(settings), settings)
    before_rotation = passwords(own_database)
    service = Service(settings)
    started = time.monotonic()
    await service.start()
    try:
        created = await full_run(service, dev, own_database, tmp_path)
    finally:
        await service.stop(grace=0)

    secrets = [
        USER_ID,
        ISSUED_USER_ID,
        CONTENT,
        UPDATED,
        QUERY,
        "marmalade-zephyr-5772",
        "aubergine-271828",
        "quince-161803",
        BAD_TOKEN,
        "canary-garbage-token-0f9e8d",
        *created,
        *before_rotation,
        *passwords(own_database),  # the password ROTATE generated
        *key_material(dev),
    ]
    assert len(set(before_rotation) - set(passwords(own_database))) == 1, "ROTATE set no new password"
    formatter = JsonFormatter()
    lines = [formatter.format(record) for record in captured.records]
    assert len(lines) > 40
    for line in lines:
        for secret in secrets:
            assert secret not in line, f"a secret is in this log line: {line[:200]}"
        json.loads(line)

    rpc_lines = [json.loads(line) for line in lines if json.loads(line).get("logger") == "tokensvc.rpc"]
    rpc_lines = [entry for entry in rpc_lines if entry["msg"] == "rpc"]
    for entry in rpc_lines:
        for name in RPC_FIELDS:
            assert name in entry, f"{name} missing from {entry}"
        assert len(entry["request_id"]) >= 8
        assert entry["status"] in grpc.StatusCode.__members__
        assert entry["duration_ms"] >= 0
        # Every caller here had a valid certificate: refused calls name it too.
        assert str(entry["caller"]).startswith("spiffe://dev.local/"), entry
    logged = {entry["method"] for entry in rpc_lines}
    for service_name, methods in {
        "MemoryService": ("Remember", "SearchMemories", "GetMemory", "ListMemories", "UpdateMemory"),
        "CapabilityService": ("VerifyCapability", "DeriveSessionKey", "IssueCapability", "RevokeCapability"),
        "KnowledgeService": (
            "CreateKnowledgeBase",
            "GetKnowledgeBase",
            "ListKnowledgeBases",
            "DeleteKnowledgeBase",
            "UploadDocument",
            "GetDocument",
            "ListDocuments",
            "DeleteDocument",
            "SearchKnowledge",
        ),
        "AdminService": (
            "RotateDatabaseCredentials",
            "GetCredentialStatus",
            "ReloadTrustBundle",
            "ListAuditEvents",
        ),
    }.items():
        for method in methods:
            assert f"/tokensvc.v1.{service_name}/{method}" in logged
    assert {"/tokensvc.v1.MemoryService/Forget", "/tokensvc.v1.MemoryService/ForgetAll"} <= logged
    statuses = {entry["status"] for entry in rpc_lines}
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED"} <= statuses
    assert {entry["caller"] for entry in rpc_lines} >= {
        "spiffe://dev.local/ctxmesh/control-plane",
        "spiffe://dev.local/admin/platform-admin",
    }
    # Request ids are unique per RPC.
    ids = [entry["request_id"] for entry in rpc_lines]
    assert len(ids) == len(set(ids))
    assert time.monotonic() - started < 120


def test_log_lines_carry_utc_millisecond_times_and_the_process() -> None:
    formatter = JsonFormatter()
    for created in (0.0, 1_764_588_215.1239996, 1_764_588_215.9999996, 1_764_588_216.0005, 951_782_400.5):
        record = logging.LogRecord("tokensvc.rpc", logging.INFO, __file__, 1, "rpc", (), None)
        record.created = created
        record.request_id = "r-1"
        entry = json.loads(formatter.format(record))
        assert entry["ts"] == datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
        assert entry["pid"] == os.getpid()
        assert entry["request_id"] == "r-1"
        assert (entry["level"], entry["logger"], entry["msg"]) == ("INFO", "tokensvc.rpc", "rpc")
