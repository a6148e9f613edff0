"""Re-embedding migrations end to end (issue 16): a memory space of several buckets moves from a
64-dimensional `hash` embedder to the embedded default model (384 dimensions) over mTLS gRPC while
launchers search and write, with the runner every replica runs."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import pytest

from tests.api.memory_support import TIMEOUT, Caller
from tests.cli.test_capability_cli import connection, tokensvc
from tests.support import SharedDatabase, audit_events, failure_of, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import admin_pb2, common_pb2, migration_pb2, migration_pb2_grpc

FACTS = [
    "The quarterly board meeting takes place in the Lisbon office.",
    "Our production database is backed up every night at 02:00 UTC.",
    "Maria from finance approves every purchase above five thousand euros.",
    "The mobile app crashes on Android 12 when the camera permission is denied.",
]
QUESTIONS = {
    "Where do the directors gather each quarter?": 0,
    "When are snapshots of the main datastore taken?": 1,
    "Who signs off on large expenses?": 2,
}
E5 = "multilingual-e5-small"


async def wait_for(stub: Any, migration_id: str, phase: int, deadline_s: float = 180.0) -> Any:
    began = time.monotonic()
    while time.monotonic() - began < deadline_s:
        got = await stub.GetEmbeddingMigration(
            migration_pb2.GetEmbeddingMigrationRequest(id=migration_id), timeout=TIMEOUT
        )
        if got.migration.phase == phase:
            return got.migration
        await asyncio.sleep(0.2)
    raise AssertionError(f"the migration never reached phase {phase}: {got.migration}")


def start_request(
    agent: str, embedder: str = E5, **fields: Any
) -> migration_pb2.StartEmbeddingMigrationRequest:
    return migration_pb2.StartEmbeddingMigrationRequest(
        memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent=agent),
        embedder=embedder,
        **fields,
    )


async def test_a_space_moves_to_the_default_model_while_launchers_search_and_write(
    migrating: Any, database: SharedDatabase, dev: DevPaths
) -> None:
    service, launchers, stub = migrating
    agent = launchers.new_agent()
    users = [launchers.caller(agent, user=f"user-{u}", per_user=True) for u in range(3)]
    await users[0].remember(*FACTS)
    for u, caller in enumerate(users[1:], start=1):
        await caller.remember(*(f"user {u} note {i} about the roadmap" for i in range(30)))
    bystander = launchers.caller()  # another agent's space: never touched
    await bystander.remember("the bystander's only memory")

    dry = await stub.StartEmbeddingMigration(start_request(agent, dry_run=True), timeout=TIMEOUT)
    assert not dry.HasField("migration")
    assert dry.estimate.rows == 64
    assert (dry.estimate.source.dimension, dry.estimate.target.dimension) == (64, 384)
    assert dry.estimate.embedder_items_per_second > 0

    failures: list[str] = []
    written: list[str] = []
    stop = asyncio.Event()

    async def search_forever(caller: Caller, expected: int) -> int:
        done = 0
        while not stop.is_set():
            try:
                found = await caller.search("roadmap note", top_k=50)
                if len(found) < expected:
                    failures.append(f"{len(found)} results, expected at least {expected}")
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code()}: {exc.details()}")
            done += 1
        return done

    async def write_forever() -> None:
        i = 0
        while not stop.is_set():
            try:
                written.append(f"written during the migration, number {i}")
                await users[1].remember(written[-1])
            except grpc.aio.AioRpcError as exc:
                failures.append(f"remember: {exc.code()}: {exc.details()}")
            i += 1
            await asyncio.sleep(0.05)

    searchers = [asyncio.create_task(search_forever(users[2], 30)) for _ in range(2)]
    writer = asyncio.create_task(write_forever())
    started = await stub.StartEmbeddingMigration(start_request(agent), timeout=TIMEOUT)
    migration_id = started.migration.id
    assert started.migration.phase == migration_pb2.MIGRATION_PHASE_BACKFILLING
    assert started.migration.rows_total >= 64
    second = await _fail(stub.StartEmbeddingMigration(start_request(agent), timeout=TIMEOUT))
    assert (second.code, second.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MIGRATION_CONFLICT")

    await wait_for(stub, migration_id, migration_pb2.MIGRATION_PHASE_RETIRING)
    await asyncio.sleep(0.5)  # writes and searches go on after the cutover too
    stop.set()
    searches = sum(await asyncio.gather(*searchers))
    await writer
    done = await wait_for(stub, migration_id, migration_pb2.MIGRATION_PHASE_SUCCEEDED)

    assert failures == []
    assert searches > 10
    assert (done.source.dimension, done.target.name, done.target.dimension) == (64, E5, 384)
    assert done.rows_done >= 64
    # Every memory written before or during the migration is there and found by the new model.
    listed = {m.content for m in await users[1].list_all(page_size=100)}
    assert set(written) <= listed
    assert len(listed) == 30 + len(written)
    for content in [written[0], written[len(written) // 2], written[-1]]:
        found = await users[1].search(content, top_k=1, mode=common_pb2.SEARCH_MODE_VECTOR)
        assert found[0].memory.content == content
    # The new model finds paraphrases the hash embedder could not.
    for question, index in QUESTIONS.items():
        found = await users[0].search(question, top_k=1, mode=common_pb2.SEARCH_MODE_VECTOR)
        assert found[0].memory.content == FACTS[index], question

    async with superuser(database) as conn:
        slots = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE dimension IS NOT NULL) AS old, count(*) FILTER (WHERE "
            "dimension_b = 384) AS new, count(*) AS total FROM tokensvc.memories WHERE agent = $1",
            agent,
        )
        assert (slots["old"], slots["new"]) == (0, slots["total"])  # the old vectors are gone
        space = await conn.fetchrow(
            "SELECT embedder, dimension, generation FROM tokensvc.memory_spaces WHERE agent = $1", agent
        )
        assert tuple(space) == (E5, 384, 1)
        untouched = await conn.fetchrow(
            "SELECT s.embedder, s.generation, count(m.embedding_b) AS b FROM tokensvc.memory_spaces s "
            "JOIN tokensvc.memories m USING (namespace, agent) WHERE s.agent = $1 GROUP BY 1, 2",
            bystander.agent,
        )
        assert tuple(untouched) == ("hash64", 0, 0)
    assert [m.content for m in await bystander.list_all()] == ["the bystander's only memory"]

    mine = await audit_events(service.port, dev, admin_pb2.AUDIT_EVENT_KIND_EMBEDDING_MIGRATION, migration_id)
    actions = [e.action for e in mine]
    assert actions == [
        "finish embedding migration (succeeded)",
        "cut over embedding migration",
        "start embedding migration",
    ]


async def _fail(call: Any) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return failure_of(caught.value)


async def test_cancel_mid_way_leaves_the_space_as_it_was(migrating: Any, database: SharedDatabase) -> None:
    _, launchers, stub = migrating
    agent = launchers.new_agent()
    caller = launchers.caller(agent)
    for start in (0, 200):
        await caller.remember(*(f"fact number {i} of a long list" for i in range(start, start + 200)))
    before = [r.memory.content for r in await caller.search("fact number 7", top_k=5)]

    started = await stub.StartEmbeddingMigration(start_request(agent), timeout=TIMEOUT)
    began = time.monotonic()
    while time.monotonic() - began < 60:  # cancel once some memories have target vectors
        got = await stub.GetEmbeddingMigration(
            migration_pb2.GetEmbeddingMigrationRequest(id=started.migration.id), timeout=TIMEOUT
        )
        if got.migration.rows_done > 0:
            break
        await asyncio.sleep(0.02)
    assert 0 < got.migration.rows_done < 400
    await stub.CancelEmbeddingMigration(
        migration_pb2.CancelEmbeddingMigrationRequest(id=started.migration.id), timeout=TIMEOUT
    )
    cancelled = await wait_for(stub, started.migration.id, migration_pb2.MIGRATION_PHASE_CANCELLED)
    assert cancelled.rows_done < 400  # it stopped mid-way
    assert "cancelled by spiffe://" in cancelled.reason
    again = await _fail(
        stub.CancelEmbeddingMigration(
            migration_pb2.CancelEmbeddingMigrationRequest(id=started.migration.id), timeout=TIMEOUT
        )
    )
    assert (again.code, again.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MIGRATION_CONFLICT")

    assert [r.memory.content for r in await caller.search("fact number 7", top_k=5)] == before
    async with superuser(database) as conn:
        row = await conn.fetchrow(
            "SELECT count(embedding_b) AS b, count(embedding) AS a FROM tokensvc.memories WHERE agent = $1",
            agent,
        )
        assert (row["b"], row["a"]) == (0, 400)
        space = await conn.fetchrow(
            "SELECT embedder, dimension, generation FROM tokensvc.memory_spaces WHERE agent = $1", agent
        )
        assert tuple(space) == ("hash64", 64, 0)


async def test_migrations_refuse_what_they_cannot_do_with_the_field_or_reason_named(
    migrating: Any, dev: DevPaths
) -> None:
    _, launchers, stub = migrating
    agent = launchers.new_agent()
    await launchers.caller(agent).remember("one memory")

    cases = [
        (start_request(agent, embedder="hash64"), grpc.StatusCode.INVALID_ARGUMENT, "embedder"),
        (start_request(agent, embedder="nope"), grpc.StatusCode.INVALID_ARGUMENT, "embedder"),
        (start_request(agent, embedder=""), grpc.StatusCode.INVALID_ARGUMENT, "embedder"),
        (start_request("Not A Label"), grpc.StatusCode.INVALID_ARGUMENT, "memory_space.agent"),
        (
            migration_pb2.StartEmbeddingMigrationRequest(embedder=E5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "memory_space",
        ),
        (start_request("never-wrote-anything"), grpc.StatusCode.NOT_FOUND, None),
    ]
    for request, code, field in cases:
        failure = await _fail(stub.StartEmbeddingMigration(request, timeout=TIMEOUT))
        assert failure.code == code, request
        if field is not None:
            assert failure.field_violations == [field], request
    missing = await _fail(
        stub.GetEmbeddingMigration(
            migration_pb2.GetEmbeddingMigrationRequest(id="not-a-uuid"), timeout=TIMEOUT
        )
    )
    assert (missing.code, missing.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, ["id"])
    unknown = await _fail(
        stub.GetEmbeddingMigration(
            migration_pb2.GetEmbeddingMigrationRequest(id="00000000-0000-4000-8000-000000000000"),
            timeout=TIMEOUT,
        )
    )
    assert unknown.code == grpc.StatusCode.NOT_FOUND

    # A launcher (even with a capability for the agent) may not migrate anything.
    caller = launchers.caller(agent)
    launcher_stub = migration_pb2_grpc.MigrationServiceStub(caller.channel)
    refused = await _fail(
        launcher_stub.StartEmbeddingMigration(start_request(agent), metadata=caller.metadata, timeout=TIMEOUT)
    )
    assert (refused.code, refused.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED")


async def test_the_cli_starts_follows_lists_and_reports_a_migration(migrating: Any, dev: DevPaths) -> None:
    service, launchers, _ = migrating
    agent = launchers.new_agent()
    await launchers.caller(agent).remember(*FACTS)
    conn = connection(service, dev)
    space = ["--namespace", "default", "--agent", agent, "--embedder", E5]

    # A start counts the space over every bucket: on Citus every shard, seconds (docs/scaling.md).
    code, out, err = await tokensvc(
        "admin", "migrate", "start", *space, "--dry-run", "--json", *conn, "--timeout", "60"
    )
    assert code == 0, err
    estimate = json.loads(out)["estimate"]
    assert (estimate["rows"], estimate["target"]["dimension"]) == ("4", 384)
    assert "migration" not in json.loads(out)

    code, out, err = await tokensvc("admin", "migrate", "start", *space, "--wait", *conn, "--timeout", "60")
    assert code == 0, err
    assert "succeeded" in out
    assert "hash64 (64) -> multilingual-e5-small (384)" in out

    code, out, err = await tokensvc("admin", "migrate", "list", "--json", *conn)
    assert code == 0, err
    mine = [m for m in json.loads(out)["migrations"] if m.get("memory_space", {}).get("agent") == agent]
    assert [m["phase"] for m in mine] == ["MIGRATION_PHASE_SUCCEEDED"]
    code, out, err = await tokensvc("admin", "migrate", "status", mine[0]["id"], *conn)
    assert code == 0, err
    assert "4/4 memories" in out

    code, _, err = await tokensvc("admin", "migrate", "cancel", mine[0]["id"], *conn)
    assert code == 1, err
    assert "the migration is succeeded: only a backfilling or paused migration can be cancelled" in err
    code, _, err = await tokensvc("admin", "migrate", "start", *space, *conn)  # pinned to it now
    assert code == 1, err
    assert "already pinned to 'multilingual-e5-small'" in err
