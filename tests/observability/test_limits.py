"""Limits: per-caller concurrency, the client's deadline reaching the database, size and count caps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from tests.api.knowledge_support import open_clients
from tests.api.memory_support import Launchers
from tests.conftest import ServiceFactory
from tests.support import SharedDatabase, failure_of, role_channel, service_settings, superuser
from tokensvc.api.policy import ANY_ROLE, RpcPolicy
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import Tenant
from tokensvc.v1 import knowledge_pb2, memory_pb2

HOLD = "/test.Limits/Hold"
SLEEP_IN_DATABASE = "/test.Limits/SleepInDatabase"
OPEN = RpcPolicy(ANY_ROLE, any_authenticated_peer=True)
SLEEP_SQL = "SELECT pg_sleep(30)"


@dataclass
class ExtraHandlers:
    """Extra RPCs: one that holds its caller until released, one that sleeps in PostgreSQL."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: int = 0
    service: Service | None = None

    async def hold(self, request: bytes, context: Any) -> bytes:
        if request == b"block":
            self.holding += 1
            try:
                await self.release.wait()
            finally:
                self.holding -= 1
        return b"done"

    async def sleep_in_database(self, request: bytes, context: Any) -> bytes:
        assert self.service is not None
        assert self.service.database is not None
        async with tenant_transaction(self.service.database.pool, Tenant("default")) as conn:
            await conn.execute(SLEEP_SQL)
        return b"slept"

    def generic(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            "test.Limits",
            {
                "Hold": grpc.unary_unary_rpc_method_handler(self.hold),
                "SleepInDatabase": grpc.unary_unary_rpc_method_handler(self.sleep_in_database),
            },
        )


@pytest.fixture
async def handlers(database: SharedDatabase, dev: DevPaths, tmp_path: Path) -> AsyncIterator[ExtraHandlers]:
    """A service with the extra RPCs and at most 2 in-flight calls per caller."""
    found = ExtraHandlers()
    found.service = Service(
        service_settings(database, dev, tmp_path, max_concurrent_rpcs_per_caller=2),
        extra_handlers=[found.generic()],
        extra_policies={HOLD: OPEN, SLEEP_IN_DATABASE: OPEN},
    )
    await found.service.start()
    yield found
    found.release.set()
    await found.service.stop(grace=0)


async def call(channel: grpc.aio.Channel, method: str, request: bytes, within: float) -> bytes:
    multicallable = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return bytes(await multicallable(request, timeout=within))


async def test_a_caller_over_its_concurrency_limit_is_refused_and_others_are_not(
    handlers: ExtraHandlers, dev: DevPaths
) -> None:
    assert handlers.service is not None
    port = handlers.service.port
    launcher, admin = role_channel(port, dev, "launcher"), role_channel(port, dev, "admin")
    try:
        calls = [asyncio.ensure_future(call(launcher, HOLD, b"block", 20)) for _ in range(3)]
        deadline = time.monotonic() + 10
        while handlers.holding < 2 or not any(c.done() for c in calls):
            assert time.monotonic() < deadline, "the calls never reached the handler"
            await asyncio.sleep(0.01)
        refused = [c for c in calls if c.done()]
        assert len(refused) == 1
        error = refused[0].exception()
        assert isinstance(error, grpc.aio.AioRpcError)
        failure = failure_of(error)
        assert failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert failure.reason == "CONCURRENCY_LIMIT"
        assert handlers.holding == 2

        # Another caller is not limited by the launcher's in-flight calls, not even twice over.
        assert await call(admin, HOLD, b"quick", 10) == b"done"
        assert await asyncio.gather(call(admin, HOLD, b"quick", 10), call(admin, HOLD, b"quick", 10)) == [
            b"done",
            b"done",
        ]
        handlers.release.set()
        held = [c for c in calls if c not in refused]
        assert await asyncio.gather(*held) == [b"done", b"done"]
        # The slots are given back: the launcher may call again.
        assert await call(launcher, HOLD, b"quick", 10) == b"done"
    finally:
        handlers.release.set()
        await launcher.close(grace=None)
        await admin.close(grace=None)


async def sleeping_queries(database: SharedDatabase) -> list[int]:
    async with superuser(database) as conn:
        rows = await conn.fetch(
            # By what it waits for: the serving role's sessions show no query text
            # (track_activities is off for tokensvc's login roles).
            "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND usename LIKE 'tokensvc\\_app\\_%' "
            "AND pid <> pg_backend_pid()"
        )
    return [int(row["pid"]) for row in rows]


async def test_a_passed_deadline_cancels_the_database_query(
    handlers: ExtraHandlers, dev: DevPaths, database: SharedDatabase
) -> None:
    assert handlers.service is not None
    channel = role_channel(handlers.service.port, dev, "launcher")
    counted = {"method": SLEEP_IN_DATABASE, "code": "DEADLINE_EXCEEDED"}
    before = REGISTRY.get_sample_value("tokensvc_rpcs_total", counted) or 0.0
    try:
        started = time.monotonic()
        sleeping = asyncio.ensure_future(call(channel, SLEEP_IN_DATABASE, b"", within=1.0))
        # The query really runs (so its disappearance below means something).
        while not await sleeping_queries(database):
            assert not sleeping.done(), "the call ended before its query was seen running"
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await sleeping
        elapsed = time.monotonic() - started
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert elapsed < 5
        deadline = time.monotonic() + 5
        while pids := await sleeping_queries(database):
            assert time.monotonic() < deadline, f"pg_sleep still running in backends {pids}"
            await asyncio.sleep(0.1)
        # Metrics (and the log line) record the deadline, not OK.
        while REGISTRY.get_sample_value("tokensvc_rpcs_total", counted) != before + 1:
            assert time.monotonic() < deadline, "the server did not record DEADLINE_EXCEEDED"
            await asyncio.sleep(0.05)
        # The pool is healthy afterwards: its connection was not left mid-query.
        assert handlers.service.database is not None
        async with tenant_transaction(handlers.service.database.pool, Tenant("default")) as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await channel.close(grace=None)


@pytest.fixture
async def launchers(start_service: ServiceFactory, dev: DevPaths, tmp_path: Path) -> AsyncIterator[Launchers]:
    service = await start_service(max_message_bytes=65536)
    pool = Launchers(service, dev, tmp_path / "launchers")
    yield pool
    await pool.aclose()


async def test_top_k_batch_and_id_caps_are_invalid_arguments(launchers: Launchers) -> None:
    caller = launchers.caller()
    too_many_results = memory_pb2.SearchMemoriesRequest(query_text="anything", top_k=101)
    assert (await caller.fail("SearchMemories", too_many_results)).code is grpc.StatusCode.INVALID_ARGUMENT
    assert (await caller.search("anything", top_k=100)) == []
    batch = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=f"m{i}") for i in range(257)])
    refused = await caller.fail("Remember", batch)
    assert refused.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == ["items"]
    assert await caller.list_all() == []  # nothing of the refused batch was stored
    ids = memory_pb2.ForgetRequest(ids=[f"00000000-0000-0000-0000-{i:012d}" for i in range(257)])
    assert (await caller.fail("Forget", ids)).code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(await caller.remember(*[f"m{i}" for i in range(256)])) == 256


async def test_knowledge_top_k_over_the_cap_is_an_invalid_argument(service: Service, dev: DevPaths) -> None:
    async with open_clients(service, dev) as clients:
        searcher = clients.searcher(["kb-any"])
        request = knowledge_pb2.SearchKnowledgeRequest(
            knowledge_base_refs=["kb-any"], query_text="q", top_k=101
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await searcher.stub.SearchKnowledge(request, metadata=searcher.metadata, timeout=10)
        failure = failure_of(caught.value)
        assert (failure.code, failure.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, ["top_k"])


async def test_a_message_over_max_message_bytes_is_resource_exhausted(launchers: Launchers) -> None:
    caller = launchers.caller()
    huge = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="x" * (100 * 1024))])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await caller.call("Remember", huge)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # The connection and the service are fine afterwards.
    assert len(await caller.remember("a small fact after the refused one")) == 1
