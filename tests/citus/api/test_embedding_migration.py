"""Re-embedding migrations on Citus: refused with a clear status before anything is written (the
runner's functions are not Citus-ready yet; docs/scaling.md says why)."""

from __future__ import annotations

from typing import Any

import grpc

from tests.api.memory_support import TIMEOUT
from tests.api.test_embedding_migration import _fail, start_request
from tests.support import superuser
from tokensvc.v1 import migration_pb2


async def test_a_migration_is_refused_as_unimplemented_and_nothing_is_written(
    migrating: Any, database: Any
) -> None:
    _, launchers, stub = migrating
    agent = launchers.new_agent()
    caller = launchers.caller(agent)
    await caller.remember("a memory of the space that would move")

    failure = await _fail(stub.StartEmbeddingMigration(start_request(agent), timeout=TIMEOUT))
    assert (failure.code, failure.reason) == (grpc.StatusCode.UNIMPLEMENTED, "NOT_IMPLEMENTED")
    assert "Citus" in failure.message

    listed = await stub.ListEmbeddingMigrations(
        migration_pb2.ListEmbeddingMigrationsRequest(), timeout=TIMEOUT
    )
    assert [m for m in listed.migrations if m.memory_space.agent == agent] == []
    async with superuser(database) as conn:
        assert (
            await conn.fetchval("SELECT count(*) FROM tokensvc.embedding_migrations WHERE agent = $1", agent)
            == 0
        )
    assert [hit.memory.content for hit in await caller.search("the space that would move", top_k=1)] == [
        "a memory of the space that would move"
    ]
