"""Re-embedding migrations on Citus: refused as UNIMPLEMENTED before any read, estimate or write,
a dry run included, for a memory space and a knowledge base (the runner's functions are not
Citus-ready yet; docs/scaling.md says why)."""

from __future__ import annotations

from typing import Any

import grpc

from tests.api.memory_support import TIMEOUT
from tests.api.test_embedding_migration import _fail, start_request
from tests.api.test_knowledge_migration import kb_request
from tests.support import audit_events, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import admin_pb2, migration_pb2


async def test_a_migration_is_refused_as_unimplemented_and_nothing_is_written(
    migrating: Any, database: Any, dev: DevPaths
) -> None:
    service, launchers, stub = migrating
    agent = launchers.new_agent()
    caller = launchers.caller(agent)
    await caller.remember("a memory of the space that would move")

    for request in (start_request(agent, dry_run=True), start_request(agent), kb_request("handbook")):
        failure = await _fail(stub.StartEmbeddingMigration(request, timeout=TIMEOUT))
        assert (failure.code, failure.reason) == (grpc.StatusCode.UNIMPLEMENTED, "NOT_IMPLEMENTED")
        assert "Citus" in failure.message

    listed = await stub.ListEmbeddingMigrations(
        migration_pb2.ListEmbeddingMigrationsRequest(), timeout=TIMEOUT
    )
    assert [m for m in listed.migrations if m.memory_space.agent == agent] == []
    async with superuser(database) as conn:
        recorded = await conn.fetchval(
            "SELECT count(*) FROM tokensvc.embedding_migrations WHERE agent = $1", agent
        )
    assert recorded == 0
    assert await audit_events(service.port, dev, admin_pb2.AUDIT_EVENT_KIND_EMBEDDING_MIGRATION, agent) == []
    assert [hit.memory.content for hit in await caller.search("the space that would move", top_k=1)] == [
        "a memory of the space that would move"
    ]
