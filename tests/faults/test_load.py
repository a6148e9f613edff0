"""Load: a few thousand concurrent RPCs from many simulated launchers, every answer checked per tenant.

30 agents (each its own launcher certificate) x 2 end-users (per_user capabilities): 60 tenants
share one in-process tokensvc. 3,000 mixed RPCs (Remember, SearchMemories, DeriveSessionKey,
VerifyCapability), 64 in flight at once, each for a random tenant. Every answer must be right
for the tenant that asked:
- VerifyCapability reports that tenant's namespace, agent and bucket (the bucket recomputed here
  from the pepper, independently of the server);
- DeriveSessionKey returns the documented per-user layout with that bucket;
- SearchMemories only ever returns memories that tenant wrote (ids and content checked once all
  writes are acknowledged), and a tenant's own text finds its own memory;
- nothing fails. Not a timing test: the throughput is printed, never asserted.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest

from tests.conftest import ServiceFactory
from tests.faults.harness import NAMESPACE, Tenant, Tenants, report
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import capability_pb2, capability_pb2_grpc, memory_pb2, memory_pb2_grpc

AGENTS = 30
USERS = ("user-a", "user-b")
RPCS = 3000
IN_FLIGHT = 64  # == the default per-caller limit, so no caller can ever exceed it
TIMEOUT = 60.0
MIX = {"Remember": 4, "SearchMemories": 3, "DeriveSessionKey": 2, "VerifyCapability": 2}


class Launchers:
    """Every tenant's stubs over its agent's own mTLS channel; what each tenant has written."""

    def __init__(self, port: int, tenants: Tenants, all_tenants: list[Tenant]):
        channels: dict[str, grpc.aio.Channel] = {}
        for tenant in all_tenants:
            if tenant.agent not in channels:
                channels[tenant.agent] = tenants.channel(port, tenant)
        self.channels = channels
        self.memory = {a: memory_pb2_grpc.MemoryServiceStub(c) for a, c in channels.items()}
        self.capability = {a: capability_pb2_grpc.CapabilityServiceStub(c) for a, c in channels.items()}
        self.written: dict[str, dict[str, str]] = defaultdict(dict)  # tenant tag -> id -> content
        self.found: list[tuple[Tenant, str, str]] = []  # (tenant, id, content) of every search result
        self.failures: list[tuple[str, str, str]] = []  # (rpc, tenant, what)
        self.calls: Counter[str] = Counter()

    async def call(self, rpc: str, tenant: Tenant, sequence: int) -> None:
        try:
            await getattr(self, rpc)(tenant, sequence)
        except grpc.aio.AioRpcError as error:
            self.failures.append((rpc, tenant.tag, f"{error.code().name}: {error.details()}"))
        except AssertionError as error:
            self.failures.append((rpc, tenant.tag, f"wrong answer: {error}"))
        self.calls[rpc] += 1

    async def Remember(self, tenant: Tenant, sequence: int) -> None:
        contents = [f"{tenant.tag} fact {sequence} {uuid.uuid4().hex}", f"{tenant.tag} note {sequence}"]
        request = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=c) for c in contents])
        response = await self.memory[tenant.agent].Remember(
            request, metadata=tenant.metadata, timeout=TIMEOUT
        )
        assert len(response.results) == len(contents)
        for result, content in zip(response.results, contents, strict=True):
            self.written[tenant.tag][result.id] = content

    async def SearchMemories(self, tenant: Tenant, sequence: int) -> None:
        own = list(self.written[tenant.tag].items())
        query = random.Random(sequence).choice(own)[1] if own else f"{tenant.tag} fact"
        request = memory_pb2.SearchMemoriesRequest(query_text=query, top_k=10)
        response = await self.memory[tenant.agent].SearchMemories(
            request, metadata=tenant.metadata, timeout=TIMEOUT
        )
        for result in response.results:
            self.found.append((tenant, result.memory.id, result.memory.content))
        if own:
            # The tenant's own, acknowledged text is found (it is an exact match of one memory).
            assert query in [r.memory.content for r in response.results], "own memory not found"

    async def DeriveSessionKey(self, tenant: Tenant, sequence: int) -> None:
        conversation = f"conv-{sequence}"
        request = capability_pb2.DeriveSessionKeyRequest(conversation_id=conversation)
        response = await self.capability[tenant.agent].DeriveSessionKey(
            request, metadata=tenant.metadata, timeout=TIMEOUT
        )
        assert response.key == f"mem:{NAMESPACE}/{tenant.agent}:{tenant.bucket}:{conversation}", response.key
        assert response.per_user
        assert response.effective_scope == capability_pb2.SESSION_SCOPE_SESSION
        assert not response.downgraded

    async def VerifyCapability(self, tenant: Tenant, sequence: int) -> None:
        response = await self.capability[tenant.agent].VerifyCapability(
            capability_pb2.VerifyCapabilityRequest(), metadata=tenant.metadata, timeout=TIMEOUT
        )
        scope = response.scope
        assert (scope.namespace, scope.agent, scope.bucket_id) == (NAMESPACE, tenant.agent, tenant.bucket)
        assert scope.per_user
        assert scope.long_term_memory

    async def aclose(self) -> None:
        for channel in self.channels.values():
            await channel.close(grace=None)


@pytest.mark.slow
async def test_thousands_of_concurrent_rpcs_each_answered_for_its_own_tenant(
    start_service: ServiceFactory, dev: DevPaths, tmp_path: Path
) -> None:
    service = await start_service()
    tenants = Tenants(dev, tmp_path / "clients")
    agents = [tenants.agent() for _ in range(AGENTS)]
    everyone = [tenants.tenant(agent, user=user, per_user=True) for agent in agents for user in USERS]
    assert len({tenant.bucket for tenant in everyone}) == len(everyone)
    launchers = Launchers(service.port, tenants, everyone)
    rng = random.Random(7)
    plan = [
        (rng.choices(list(MIX), weights=list(MIX.values()))[0], rng.choice(everyone), sequence)
        for sequence in range(RPCS)
    ]
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def bounded(rpc: str, tenant: Tenant, sequence: int) -> None:
        async with slots:
            await launchers.call(rpc, tenant, sequence)

    try:
        # Every tenant's memory space exists before the mix starts (one Remember each).
        await asyncio.gather(*(bounded("Remember", tenant, -1 - i) for i, tenant in enumerate(everyone)))
        started = time.monotonic()
        await asyncio.gather(*(bounded(*step) for step in plan))
        elapsed = time.monotonic() - started
    finally:
        await launchers.aclose()

    assert not launchers.failures, f"{len(launchers.failures)} failed calls, e.g. {launchers.failures[:5]}"
    assert sum(launchers.calls.values()) == RPCS + len(everyone)
    # With every write acknowledged: each search result is a memory its own tenant wrote.
    owner = {memory_id: tag for tag, written in launchers.written.items() for memory_id in written}
    foreign = [
        (tenant.tag, memory_id, owner.get(memory_id))
        for tenant, memory_id, content in launchers.found
        if owner.get(memory_id) != tenant.tag or launchers.written[tenant.tag][memory_id] != content
    ]
    assert not foreign, f"search results from other tenants (or unknown): {foreign[:5]}"
    assert launchers.found, "no search returned anything: nothing was checked"
    report(
        "load",
        rpcs=RPCS,
        tenants=len(everyone),
        in_flight=IN_FLIGHT,
        seconds=elapsed,
        rpcs_per_second=RPCS / elapsed,
        search_results_checked=len(launchers.found),
        **{f"calls_{rpc}": count for rpc, count in sorted(launchers.calls.items())},
    )
