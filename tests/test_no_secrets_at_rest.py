"""Raw end-user ids and tokens never reach the database or the logs (design rule 7).

A run with known, distinctive user ids goes through every RPC that sees them; then the whole
database is dumped with pg_dump and every log record is searched for them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid

import pytest

from tests.support import SharedDatabase, dev_capability, role_channel
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres.embedded import _bin_dir
from tokensvc.v1 import capability_pb2, capability_pb2_grpc


def pg_dump(database: SharedDatabase) -> str:
    superuser = FileCredentialSource(database.superuser_credential_dir).read()
    result = subprocess.run(
        [
            str(_bin_dir() / "pg_dump"),
            "--data-only",
            "--no-owner",
            database.dsn.replace("postgresql://", f"postgresql://{superuser.username}@"),
        ],
        env={**os.environ, "PGPASSWORD": superuser.password},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


async def test_user_ids_and_tokens_appear_in_neither_the_database_nor_the_logs(
    service: Service, dev: DevPaths, database: SharedDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    users = [f"end-user-{uuid.uuid4().hex}" for _ in range(3)]
    tokens = [dev_capability(dev, user=user, per_user=True, long_term_memory=True) for user in users]
    async with role_channel(service.port, dev, "launcher") as channel:
        stub = capability_pb2_grpc.CapabilityServiceStub(channel)
        for token in tokens:
            metadata = (("authorization", f"Bearer {token}"),)
            await stub.VerifyCapability(capability_pb2.VerifyCapabilityRequest(), metadata=metadata)
            await stub.DeriveSessionKey(
                capability_pb2.DeriveSessionKeyRequest(conversation_id="c1"), metadata=metadata
            )
    async with role_channel(service.port, dev, "control-plane") as channel:
        stub = capability_pb2_grpc.CapabilityServiceStub(channel)
        issued = await stub.IssueCapability(
            capability_pb2.IssueCapabilityRequest(
                namespace="default", agent="dev-agent", user=users[0], per_user=True
            )
        )
        await stub.RevokeCapability(capability_pb2.RevokeCapabilityRequest(jti=issued.jti))
    tokens.append(issued.token)

    dump = pg_dump(database)
    logs = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert "capability_revocations" in dump  # the dump really holds the data
    for user in users:
        assert user not in dump
        assert user not in logs
    for token in tokens:
        signature = token.rsplit(".", 1)[1]
        assert signature not in dump
        assert signature not in logs


def test_pg_dump_helper_finds_what_is_there(database: SharedDatabase) -> None:
    # Guard against a dump that silently comes back empty (which would make the test above pass).
    assert "schema_migrations" in pg_dump(database)
