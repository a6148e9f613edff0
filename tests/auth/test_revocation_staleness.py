"""A replica that cannot reach the revocation table stops vouching for capabilities (fails closed)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime

import pytest

from tokensvc.auth.revocation import RevocationList
from tokensvc.storage.records import Revocation, RevocationKind, RevocationSnapshot


class UnreachableAfterStart:
    """A revocation store that answers once (at start) and then fails like a lost database."""

    def __init__(self) -> None:
        self.reachable = True

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        raise OSError("database unreachable")

    async def since(self, moment: datetime) -> RevocationSnapshot:
        if not self.reachable:
            raise OSError("database unreachable")
        return RevocationSnapshot((), datetime.now(UTC))

    async def all(self) -> RevocationSnapshot:
        return await self.since(datetime.min)

    async def find(self, keys: Collection[tuple[RevocationKind, str]]) -> list[Revocation]:
        return []


async def test_the_list_is_current_while_polls_succeed_and_stale_once_they_keep_failing() -> None:
    now = [1000.0]
    store = UnreachableAfterStart()
    revocations = RevocationList(store, poll_seconds=1.0, clock=lambda: now[0])
    await revocations.start()
    await revocations.stop()  # the test drives the polls itself
    assert revocations.is_current

    now[0] += 3
    await revocations.poll_once()
    assert revocations.is_current

    assert revocations.age_seconds == 0

    store.reachable = False
    for _ in range(10):
        now[0] += 1
        with pytest.raises(OSError, match="unreachable"):
            await revocations.poll_once()
    assert not revocations.is_current
    assert revocations.age_seconds == 10 > revocations.max_staleness  # the gauge the alert reads

    store.reachable = True
    await revocations.poll_once()
    assert revocations.is_current
    assert revocations.age_seconds == 0


async def test_a_service_whose_revocation_list_is_stale_answers_unavailable(service, dev) -> None:  # type: ignore[no-untyped-def]

    import grpc

    from tests.support import dev_capability, failure_of, role_channel
    from tokensvc.v1 import capability_pb2, capability_pb2_grpc

    token = dev_capability(dev)
    service.revocations.max_staleness = -1.0  # as if every poll since start had failed
    try:
        async with role_channel(service.port, dev, "launcher") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await capability_pb2_grpc.CapabilityServiceStub(channel).VerifyCapability(
                    capability_pb2.VerifyCapabilityRequest(), metadata=(("authorization", f"Bearer {token}"),)
                )
    finally:
        service.revocations.max_staleness = 6.0
    failure = failure_of(caught.value)
    assert failure.code == grpc.StatusCode.UNAVAILABLE
    assert failure.reason == "DATABASE_UNAVAILABLE"
