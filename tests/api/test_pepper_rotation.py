"""Pepper rotation loses nothing: rows under an older pepper's bucket move on first access."""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

from tests.api.memory_support import Launchers, count_rows
from tests.support import SharedDatabase, role_channel
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import admin_pb2, admin_pb2_grpc, capability_pb2

# The status counts every live memory per pepper version: milliseconds on one node, several
# seconds across a Citus cluster's shards (docs/scaling.md). Not a latency bound.
STATUS_TIMEOUT = 60


async def test_a_new_pepper_moves_a_users_memories_on_first_access_and_keeps_session_history(
    start_service,
    dev: DevPaths,
    database: SharedDatabase,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    peppers = tmp_path / "peppers"
    shutil.copytree(dev.pepper_dir, peppers)
    before = await start_service(pepper_dir=str(peppers))
    launchers = Launchers(before, dev, tmp_path)
    try:
        agent = launchers.new_agent()
        old = launchers.caller(agent, user="user-pepper", per_user=True)
        stored = await old.remember("the user keeps bees", "the user plays the cello")
        old_bucket = await old.bucket()
        old_key = (
            await old.channel.unary_unary(
                "/tokensvc.v1.CapabilityService/DeriveSessionKey",
                request_serializer=capability_pb2.DeriveSessionKeyRequest.SerializeToString,
                response_deserializer=capability_pb2.DeriveSessionKeyResponse.FromString,
            )(capability_pb2.DeriveSessionKeyRequest(conversation_id="c1"), metadata=old.metadata)
        ).key
        assert old_bucket.startswith("v1.")

        (peppers / "v2").write_text(base64.urlsafe_b64encode(os.urandom(32)).decode())
        after = await start_service(pepper_dir=str(peppers))
        new = launchers.caller(agent, user="user-pepper", per_user=True, service=after)
        new_bucket = await new.bucket()
        assert new_bucket.startswith("v2.")
        assert await count_rows(database, old_bucket) == 2

        found = {hit.memory.id for hit in await new.search("bees and cellos", top_k=10)}
        assert found == set(stored)
        assert await count_rows(database, old_bucket) == 0
        assert await count_rows(database, new_bucket) == 2

        session = await new.channel.unary_unary(
            "/tokensvc.v1.CapabilityService/DeriveSessionKey",
            request_serializer=capability_pb2.DeriveSessionKeyRequest.SerializeToString,
            response_deserializer=capability_pb2.DeriveSessionKeyResponse.FromString,
        )(capability_pb2.DeriveSessionKeyRequest(conversation_id="c1"), metadata=new.metadata)
        assert session.key == f"mem:default/{agent}:{new_bucket}:c1"
        assert list(session.previous_keys) == [old_key]

        async with role_channel(after.port, dev, "admin") as channel:
            status = await admin_pb2_grpc.AdminServiceStub(channel).GetCredentialStatus(
                admin_pb2.GetCredentialStatusRequest(), timeout=STATUS_TIMEOUT
            )
        versions = {p.pepper_version: p for p in status.status.pepper_versions}
        assert versions[2].current
        assert versions[2].row_count >= 2
        assert not versions[1].current
    finally:
        await launchers.aclose()
