"""EmbeddingMigrations and MigrationRunner on the in-process stores: no database.

The stores' contract is the conformance suite's; these tests pin what the domain adds: refusals,
the dry run, writes during a backfill getting both vectors, a failing target embedder backing off
then pausing (with the reason, audited) and resuming, and a stale pin redone for the new model.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from tokensvc.audit import AuditLog
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import EmbedderRegistry, HashEmbedder
from tokensvc.errors import DatabaseUnavailable, EmbedderUnavailable, InvalidArgument, NotFound
from tokensvc.memory.service import LongTermMemory, RememberItem, SearchMode, SearchQuery
from tokensvc.reembedding import (
    EmbeddingMigrations,
    MigrationConflict,
    MigrationRunner,
    MigrationState,
    RunnerSettings,
)
from tokensvc.storage.caching import CachingMemoryStore
from tokensvc.storage.inprocess import (
    InProcessAuditStore,
    InProcessEmbeddingMigrationStore,
    InProcessMemoryStore,
)
from tokensvc.storage.reembedding_records import EmbeddingMigration, PendingMemory


class FlakyEmbedder(HashEmbedder):
    """A hash embedder of another dimension that fails while `failing` is set."""

    def __init__(self) -> None:
        super().__init__("target", 32)
        self.failing = False
        self.calls = 0
        self.texts: list[str] = []

    async def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.texts.extend(texts)
        if self.failing:
            raise EmbedderUnavailable("the endpoint answered 503")
        return await super().embed_documents(texts)


def scope(user: int) -> TenantScope:
    return TenantScope(
        namespace="team-a",
        agent="helper",
        bucket_id=f"v1.{base64.b32encode(bytes([user]) + os.urandom(19)).decode().lower().rstrip('=')}",
        previous_bucket_ids=(),
        agent_bucket_id="",
        per_user=True,
        registry=None,
        long_term_memory=True,
        knowledge_bases=(),
        run_id="run-1",
        jti="jti-1",
        issued_at=0,
        expires_at=0,
    )


def wired(
    memories: InProcessMemoryStore,
    migrations: InProcessEmbeddingMigrationStore,
    embedders: EmbedderRegistry,
    audit_store: InProcessAuditStore,
    settings: RunnerSettings,
) -> tuple[MigrationRunner, EmbeddingMigrations, LongTermMemory]:
    """A runner, the operators' service and long-term memory over the same in-process stores."""
    audit = AuditLog(audit_store)
    runner = MigrationRunner(migrations, embedders, audit, settings)
    service = EmbeddingMigrations(migrations, memories, embedders, audit, wake=runner.wake)
    memory = LongTermMemory(memories, embedders, default_embedder="hash")
    return runner, service, memory


@pytest.fixture
def world() -> tuple[
    LongTermMemory, EmbeddingMigrations, MigrationRunner, FlakyEmbedder, InProcessAuditStore
]:
    memories = InProcessMemoryStore()
    audit_store = InProcessAuditStore()
    migrations = InProcessEmbeddingMigrationStore(memories, audit_store)
    target = FlakyEmbedder()
    embedders = EmbedderRegistry({"hash": HashEmbedder(), "target": target})
    audit = AuditLog(audit_store)
    runner = MigrationRunner(
        migrations,
        embedders,
        audit,
        RunnerSettings(pause_after=2, backoff_seconds=0.001, retire_seconds=0, batch_size=2),
    )
    service = EmbeddingMigrations(migrations, memories, embedders, audit, wake=runner.wake)
    memory = LongTermMemory(memories, embedders, default_embedder="hash")
    return memory, service, runner, target, audit_store


def items(*contents: str) -> list[RememberItem]:
    return [RememberItem(c, {}, None, None) for c in contents]


async def test_a_failing_target_backs_off_then_pauses_with_the_reason_and_resumes(world) -> None:  # type: ignore[no-untyped-def]
    memory, service, runner, target, audit = world
    users = [scope(u) for u in range(2)]
    for u, user in enumerate(users):
        await memory.remember(user, items(*(f"user {u} fact {i}" for i in range(3))))

    with pytest.raises(InvalidArgument) as caught:
        await service.start("team-a", "helper", "hash", dry_run=False, actor="admin")
    assert caught.value.field == "embedder"
    with pytest.raises(NotFound):
        await service.start("team-a", "nobody", "target", dry_run=False, actor="admin")
    _, estimate = await service.start("team-a", "helper", "target", dry_run=True, actor="admin")
    assert (estimate.rows, estimate.source.dimension, estimate.target.dimension) == (6, 384, 32)

    migration, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert migration is not None
    with pytest.raises(MigrationConflict):
        await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    target.failing = True  # after the start, which measured it on a batch of the space's memories
    assert await runner.step()  # two failures in a row: paused
    paused = (await service.get(migration.id)).migration
    assert paused.state is MigrationState.PAUSED
    assert "503" in paused.reason
    assert not await runner.step()  # a paused migration is not run
    # Searches went on with the pinned embedder all along.
    hits = await memory.search(users[0], SearchQuery("fact", None, 10, None, None, SearchMode.VECTOR))
    assert len(hits) == 3

    target.failing = False
    await service.resume(migration.id, "admin")
    # Written while it backfills: the write embeds for the target too (nothing left for the runner).
    await memory.remember(users[1], items("written during the backfill"))
    while await runner.step():
        pass
    done = (await service.get(migration.id)).migration
    assert done.state is MigrationState.SUCCEEDED
    assert done.rows_done == 6  # the dual-written memory was never embedded by the runner
    hits = await memory.search(
        users[1], SearchQuery("written during the backfill", None, 1, None, None, SearchMode.VECTOR)
    )
    assert hits[0].item.content == "written during the backfill"
    events = [r.action for r in await audit.page(before_id=None, kinds=[], since=None, until=None, limit=50)]
    assert events == [
        "finish embedding migration (succeeded)",
        "cut over embedding migration",
        "resume embedding migration",
        "pause embedding migration",
        "start embedding migration",
    ]


async def test_a_write_with_a_stale_pin_is_embedded_again_for_the_new_model(world) -> None:  # type: ignore[no-untyped-def]
    memory, service, runner, target, _ = world
    user = scope(7)
    await memory.remember(user, items("before the migration"))
    stale = LongTermMemory(
        CachingMemoryStore(memory._store, pin_seconds=3600), memory._embedders, default_embedder="hash"
    )
    await stale.remember(user, items("a replica caches the pin"))  # this replica now holds the old pin
    migration, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert migration is not None
    while await runner.step():
        pass
    calls = target.calls
    # The stale replica's write is refused by storage and redone with the target embedder.
    await stale.remember(user, items("after the cutover"))
    assert target.calls == calls + 1
    hits = await memory.search(user, SearchQuery("after the cutover", None, 1, None, None, SearchMode.VECTOR))
    assert hits[0].item.content == "after the cutover"


async def test_a_start_beside_an_unfinished_migration_is_refused_before_it_embeds(world) -> None:  # type: ignore[no-untyped-def]
    """The estimate embeds a whole batch: a start that can only conflict must not spend it beside
    the running migration's own batches."""
    memory, service, _, target, _ = world
    await memory.remember(scope(1), items("a fact", "another fact"))
    migration, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert migration is not None
    calls = target.calls
    with pytest.raises(MigrationConflict, match="team-a/helper already has a migration"):
        await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert target.calls == calls
    _, estimate = await service.start("team-a", "helper", "target", dry_run=True, actor="admin")
    assert estimate.rows == 2  # a dry run still estimates
    assert target.calls == calls + 1


async def test_the_estimate_embeds_a_bounded_sample_of_long_memories(world) -> None:  # type: ignore[no-untyped-def]
    """The start waits for the estimate: a whole batch of long texts took the embedded model 12-35 s
    (past a start's deadline), so long texts are sampled fewer at a time."""
    memory, service, _, target, _ = world
    await memory.remember(scope(1), items(*[f"fact {i}: " + "a long memory " * 300 for i in range(3)]))
    _, estimate = await service.start("team-a", "helper", "target", dry_run=True, actor="admin")
    assert estimate.rows == 3
    assert estimate.items_per_second > 0
    assert len(target.texts) == 1  # about 4,000 characters each: one is the sample
    await memory.remember(scope(1), items(*[f"short {i}" for i in range(100)]))
    target.texts.clear()
    await service.start("team-a", "helper", "target", dry_run=True, actor="admin")
    assert 1 < len(target.texts) <= 64  # short ones: a batch


class SlowEmbedder(HashEmbedder):
    """A hash embedder of another dimension that takes `seconds` for every batch."""

    def __init__(self, seconds: float) -> None:
        super().__init__("target", 32)
        self.seconds = seconds

    async def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        await asyncio.sleep(self.seconds)
        return await super().embed_documents(texts)


async def test_a_batch_slower_than_the_lease_keeps_it_and_the_migration_finishes() -> None:
    """Leased from its read to its write, a batch that outlasts the lease would find it lapsed at
    every write and never progress: the runner renews the lease while it works."""
    memories = InProcessMemoryStore()
    audit_store = InProcessAuditStore()
    migrations = InProcessEmbeddingMigrationStore(memories, audit_store)
    embedders = EmbedderRegistry({"hash": HashEmbedder(), "target": SlowEmbedder(0.5)})
    audit = AuditLog(audit_store)
    lease = 0.3
    runner = MigrationRunner(
        migrations, embedders, audit, RunnerSettings(lease_seconds=lease, retire_seconds=0, batch_size=2)
    )
    service = EmbeddingMigrations(migrations, memories, embedders, audit, wake=runner.wake)
    memory = LongTermMemory(memories, embedders, default_embedder="hash")
    await memory.remember(scope(1), items(*(f"fact {i}" for i in range(6))))
    migration, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert migration is not None

    for _ in range(3):  # each step claims it again; without renewals none would write a batch
        if not await runner.step():
            break
    done = (await service.get(migration.id)).migration
    assert done.state is MigrationState.SUCCEEDED
    assert done.rows_done == 6


class HangingEmbedder(HashEmbedder):
    """A hash embedder that answers its first call (the start's estimate), then hangs."""

    def __init__(self) -> None:
        super().__init__("hanging", 16)
        self.calls = 0

    async def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        if self.calls > 1:
            await asyncio.Event().wait()
        return await super().embed_documents(texts)


async def test_a_stuck_migration_does_not_hold_back_the_next_one() -> None:
    """The runner drives two migrations at once: the older one, whose embedder hangs, keeps one
    slot, and the younger one still finishes (with one slot it would wait forever)."""
    memories = InProcessMemoryStore()
    audit_store = InProcessAuditStore()
    migrations = InProcessEmbeddingMigrationStore(memories, audit_store)
    hanging = HangingEmbedder()
    embedders = EmbedderRegistry({"hash": HashEmbedder(), "target": FlakyEmbedder(), "hanging": hanging})
    runner, service, memory = wired(
        memories,
        migrations,
        embedders,
        audit_store,
        RunnerSettings(retire_seconds=0, batch_size=2, poll_seconds=0.01),
    )
    await memory.remember(replace(scope(1), agent="stuck"), items("a fact that never moves"))
    await memory.remember(scope(2), items(*(f"fact {i}" for i in range(5))))
    stuck, _ = await service.start("team-a", "stuck", "hanging", dry_run=False, actor="admin")
    moving, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert stuck is not None
    assert moving is not None

    running = asyncio.create_task(runner.run())
    try:
        for _ in range(1000):
            if (await service.get(moving.id)).migration.state is MigrationState.SUCCEEDED:
                break
            await asyncio.sleep(0.01)
        assert (await service.get(moving.id)).migration.state is MigrationState.SUCCEEDED
        assert (await service.get(stuck.id)).migration.state is MigrationState.BACKFILLING
        assert hanging.calls == 2  # the stuck one's first batch is still out
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


class CountingStore(InProcessEmbeddingMigrationStore):
    """The in-process store, counting the backfill's reads."""

    reads = 0

    async def pending(self, migration: EmbeddingMigration, *, limit: int) -> list[PendingMemory]:
        self.reads += 1
        return await super().pending(migration, limit=limit)


async def test_a_space_backfill_reads_hundreds_of_memories_at_once_and_embeds_them_in_batches() -> None:
    """On Citus each read of a space is a multi-shard statement (seconds): one read serves many
    embedder batches, and the backfill is as complete as with one read per batch."""
    memories = InProcessMemoryStore()
    audit_store = InProcessAuditStore()
    migrations = CountingStore(memories, audit_store)
    target = FlakyEmbedder()
    embedders = EmbedderRegistry({"hash": HashEmbedder(), "target": target})
    runner, service, memory = wired(
        memories, migrations, embedders, audit_store, RunnerSettings(retire_seconds=0, batch_size=2)
    )
    for user in range(4):
        await memory.remember(scope(user), items(*(f"user {user} fact {i}" for i in range(10))))
    migration, _ = await service.start("team-a", "helper", "target", dry_run=False, actor="admin")
    assert migration is not None
    target.calls = 0
    while await runner.step():
        pass
    done = (await service.get(migration.id)).migration
    assert (done.state, done.rows_done) == (MigrationState.SUCCEEDED, 40)
    assert target.calls == 20  # batches of 2
    # One read of all 40, one that finds nothing after them, one from the start before the cutover.
    assert migrations.reads == 3


class AwayStore(InProcessEmbeddingMigrationStore):
    """The in-process store, whose backfill reads fail (a database that is away)."""

    reads = 0

    async def pending(self, migration: EmbeddingMigration, *, limit: int) -> list[PendingMemory]:
        self.reads += 1
        raise DatabaseUnavailable()


async def test_a_failing_drive_waits_a_poll_before_the_migration_is_tried_again() -> None:
    """A drive that fails (the database is away) holds its slot for `poll_seconds`: the runner
    does not ask again at once, in a loop."""
    memories = InProcessMemoryStore()
    audit_store = InProcessAuditStore()
    migrations = AwayStore(memories, audit_store)
    embedders = EmbedderRegistry({"hash": HashEmbedder(), "target": FlakyEmbedder()})
    runner, service, memory = wired(
        memories,
        migrations,
        embedders,
        audit_store,
        RunnerSettings(retire_seconds=0, batch_size=2, poll_seconds=0.1),
    )
    await memory.remember(scope(1), items("a fact"))
    await service.start("team-a", "helper", "target", dry_run=False, actor="admin")

    running = asyncio.create_task(runner.run())
    await asyncio.sleep(0.5)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    # About one read per slot and poll (two slots, five polls); a loop without the wait: thousands.
    assert 1 <= migrations.reads <= 40
