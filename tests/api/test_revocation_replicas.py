"""Revocation across replicas: two tokensvc servers on one database, revoked on one, refused by both."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import grpc
import jwt
import pytest

from tests.api.test_capability_service import assert_bad_token, refusal, revoke, stub_for, verify
from tests.support import SharedDatabase, Signer, connect_as, failure_of
from tokensvc.auth.devpki import DevPaths

# The documented bound (RevokeCapability in capability.proto): every replica within 5 seconds.
REPLICA_BOUND_SECONDS = 5.0


async def seconds_until_revoked(port: int, dev: DevPaths, token: str) -> float:
    """Poll a replica until it refuses `token` as revoked; how long that took."""
    started = time.monotonic()
    async with stub_for(port, dev, "launcher") as launcher:
        while time.monotonic() - started < REPLICA_BOUND_SECONDS + 1:
            try:
                await verify(launcher, token)
            except grpc.aio.AioRpcError as error:
                assert_bad_token(failure_of(error), "CAPABILITY_REVOKED")
                return time.monotonic() - started
            await asyncio.sleep(0.05)
    pytest.fail(f"the replica still accepted a revoked capability after {REPLICA_BOUND_SECONDS + 1} s")


@pytest.mark.parametrize("target", ["jti", "run_id"])
async def test_revocation_on_one_replica_is_honoured_by_another_within_five_seconds(
    start_service: Any, dev: DevPaths, target: str
) -> None:
    replica_a, replica_b = await start_service(), await start_service()
    signer = Signer.dev(dev)
    run_id, jti = f"run-{uuid.uuid4()}", uuid.uuid4().hex
    token = signer.token(sub=run_id, jti=jti)
    for replica in (replica_a, replica_b):
        # Both accept it, and both now hold it in their verification cache.
        async with stub_for(replica.port, dev, "launcher") as launcher:
            await verify(launcher, token)
            await verify(launcher, token)

    async with stub_for(replica_a.port, dev, "control-plane") as control_plane:
        await revoke(control_plane, **{target: jti if target == "jti" else run_id})
    async with stub_for(replica_a.port, dev, "launcher") as launcher:
        assert_bad_token(await refusal(verify(launcher, token)), "CAPABILITY_REVOKED")

    assert await seconds_until_revoked(replica_b.port, dev, token) < REPLICA_BOUND_SECONDS


async def test_a_forged_announcement_revokes_nothing_on_a_running_replica(
    start_service: Any, dev: DevPaths, database: SharedDatabase
) -> None:
    # Issue 35, F15: any role can NOTIFY on the revocations' channel; here the serving login role.
    replica_a, replica_b = await start_service(), await start_service()
    signer = Signer.dev(dev)
    forged = signer.token(sub=f"run-{uuid.uuid4()}", jti=uuid.uuid4().hex)
    marker_jti = uuid.uuid4().hex
    marker = signer.token(sub=f"run-{uuid.uuid4()}", jti=marker_jti)
    claims = jwt.decode(forged, options={"verify_signature": False})
    async with stub_for(replica_b.port, dev, "launcher") as launcher:
        await verify(launcher, forged)
        await verify(launcher, marker)

    async with connect_as(database.app_credential_dir, database.dsn) as serving:
        for kind, value in (("jti", claims["jti"]), ("run", claims["sub"])):
            await serving.execute(
                "SELECT pg_notify('tokensvc_revocations', json_build_object('kind', $1::text,"
                " 'value', $2::text, 'revoked_at', now())::text)",
                kind,
                value,
            )
    # A real revocation committed after the forged announcements: once replica B honours it (as
    # fast as before), B has handled those too.
    async with stub_for(replica_a.port, dev, "control-plane") as control_plane:
        await revoke(control_plane, jti=marker_jti)
    assert await seconds_until_revoked(replica_b.port, dev, marker) < REPLICA_BOUND_SECONDS

    async with stub_for(replica_b.port, dev, "launcher") as launcher:
        await verify(launcher, forged)
