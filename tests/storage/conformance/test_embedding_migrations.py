"""EmbeddingMigrationStore and the vector slots of MemoryStore, against every implementation.

A migration fills the slot its space does not read; the cutover switches the space to it only
when every live memory has a target vector, and is ordered with every write of the space; a write
for a generation that is gone is refused (`StaleMemorySpace`); leases keep one runner at a time.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import numpy as np
import pytest

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.support import (
    DIM,
    NAMESPACE,
    SPACE,
    axis,
    memory,
    new_bucket,
    search,
    vector_query,
)
from tokensvc.storage.ports import EmbeddingMigrationStore, MemoryStore, StaleMemorySpace
from tokensvc.storage.records import EmbedderSpec, Tenant
from tokensvc.storage.reembedding_records import MemorySpaceMigration, MigrationState, PendingMemory

TARGET = EmbedderSpec("target", "target-model", 4, True)
LEASE = 30.0


def target_vector(i: int) -> np.ndarray:
    return axis(i % 4, 4)


def embedded(pending: PendingMemory) -> np.ndarray:
    """The target "model": fact <t>.<i> points along axis i mod 4."""
    last = pending.content[-1]
    return target_vector(int(last) if last.isdigit() else 0)


async def space_with(memories: MemoryStore, buckets: int, per_bucket: int) -> tuple[str, list[Tenant]]:
    agent = f"agent-{uuid.uuid4().hex[:12]}"
    tenants = [Tenant(NAMESPACE, agent, (new_bucket(),), generation=0) for _ in range(buckets)]
    await memories.pin_space(Tenant(NAMESPACE, agent), SPACE)
    for t, tenant in enumerate(tenants):
        await memories.insert(
            tenant, tenant.buckets[0], [memory(f"fact {t}.{i}", axis(i % DIM)) for i in range(per_bucket)]
        )
    return agent, tenants


def planned(agent: str, generation: int = 0, rows_total: int = 0) -> MemorySpaceMigration:
    return MemorySpaceMigration(
        id=str(uuid.uuid4()),
        namespace=NAMESPACE,
        agent=agent,
        from_generation=generation,
        rows_total=rows_total,
        source=SPACE.embedder,
        target=TARGET,
        state=MigrationState.BACKFILLING,
        created_by="spiffe://test/admin",
    )


async def claim(
    store: EmbeddingMigrationStore, runner: str, migration_id: str, *, lease_seconds: float = LEASE
) -> MemorySpaceMigration:
    """Claim until this migration is the one claimed (other tests' migrations share PostgreSQL)."""
    for _ in range(200):
        claimed = await store.claim(
            runner, lease_seconds=lease_seconds, embedders=[TARGET.name], retire_after_seconds=0
        )
        assert claimed is not None
        if claimed.id == migration_id:
            return claimed
        # Another test's migration (PostgreSQL is shared by the session): finish it.
        await store.transition(claimed.id, expect=[claimed.state], state=MigrationState.CANCELLED)
    raise AssertionError("never claimed")


async def backfill(
    store: EmbeddingMigrationStore, migration: MemorySpaceMigration, runner: str
) -> MemorySpaceMigration:
    while batch := await store.pending(migration, limit=3):
        stored = await store.store_vectors(
            migration, runner, [(p, embedded(p)) for p in batch], lease_seconds=LEASE
        )
        assert stored is not None
        migration = stored
    return migration


async def test_a_migration_fills_the_other_slot_and_the_cutover_switches_searches_to_it(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, tenants = await space_with(memories, buckets=3, per_bucket=4)
    assert await migrations.space_size(NAMESPACE, agent) == (12, len("fact 0.0"))
    created = await migrations.create(planned(agent, rows_total=12))
    assert created is not None
    assert created.state is MigrationState.BACKFILLING
    assert created.rows_total == 12  # the caller's count, kept
    assert created.rows_done == 0
    assert created.target_slot == 1
    assert await migrations.create(planned(agent)) is None  # one active migration per space

    runner = "runner-a"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    assert migration.rows_done == 12
    # Until the cutover, searches read the old slot: 8-dimensional vectors.
    tenant = tenants[0]
    found = await search(memories, tenant, tenant.buckets[0], vector_query(axis(1), k=10))
    assert len(found) == 4
    assert found[0].item.content == "fact 0.1"

    assert await migrations.cut_over(migration, runner)
    space = await memories.get_space(Tenant(NAMESPACE, agent))
    assert space is not None
    assert space.generation == 1
    assert space.embedder == TARGET
    assert space.slot == 1
    after = Tenant(NAMESPACE, agent, tenant.buckets, generation=1)
    found = await search(memories, after, tenant.buckets[0], vector_query(axis(2, 4), k=10))
    assert len(found) == 4
    assert {c.item.content for c in found[:1]} == {"fact 0.2"}
    current = await migrations.get(created.id)
    assert current is not None
    assert current.state is MigrationState.RETIRING
    assert current.cut_over_at is not None


async def test_the_cutover_waits_for_memories_written_during_the_backfill(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, tenants = await space_with(memories, buckets=2, per_bucket=2)
    created = await migrations.create(planned(agent))
    assert created is not None
    runner = "runner-b"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    late = tenants[1]
    await memories.insert(late, late.buckets[0], [memory("written during the migration", axis(3))])
    assert not await migrations.cut_over(migration, runner)  # one memory has no target vector
    assert await migrations.rewind(migration, runner)
    migration = await backfill(migrations, replace(migration, cursor=None), runner)
    assert migration.rows_done == 5
    assert migration.rows_total == 5
    assert await migrations.cut_over(migration, runner)
    found = await search(
        memories, replace(late, generation=1), late.buckets[0], vector_query(target_vector(0), k=10)
    )
    assert "written during the migration" in {c.item.content for c in found}


async def test_a_write_for_a_generation_that_is_gone_is_refused_and_writes_nothing(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, tenants = await space_with(memories, buckets=1, per_bucket=1)
    created = await migrations.create(planned(agent))
    assert created is not None
    runner = "runner-c"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    assert await migrations.cut_over(migration, runner)
    stale = tenants[0]  # still declares generation 0
    with pytest.raises(StaleMemorySpace):
        await memories.insert(stale, stale.buckets[0], [memory("embedded by the old model", axis(0))])
    existing = (
        await memories.list_page(stale, stale.buckets[0], limit=1, after=None, filter_=None, embedder="x")
    )[0]
    with pytest.raises(StaleMemorySpace):  # an update embedded by the old model, likewise
        await memories.update(
            stale, stale.buckets[0], existing.id, content=("fact 0.0, edited", b"z" * 32, axis(4)),
            metadata=None, ttl_seconds=None, embedder="x",
        )  # fmt: skip
    current = replace(stale, generation=1)
    assert await memories.find_existing(current, stale.buckets[0], [], []) == []
    rows = await memories.list_page(
        current, stale.buckets[0], limit=10, after=None, filter_=None, embedder="x"
    )
    assert [r.content for r in rows] == ["fact 0.0"]
    stored = await memories.insert(
        current, current.buckets[0], [memory("embedded by the new one", axis(1, 4))]
    )
    assert stored[0].inserted


async def test_a_content_change_during_the_backfill_is_embedded_again(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, tenants = await space_with(memories, buckets=1, per_bucket=2)
    created = await migrations.create(planned(agent))
    assert created is not None
    runner = "runner-d"
    migration = await claim(migrations, runner, created.id)
    read = await migrations.pending(migration, limit=10)
    tenant = tenants[0]
    changed = next(p for p in read if p.content == "fact 0.0")
    await memories.update(
        tenant, tenant.buckets[0], changed.id, content=("fact 0.0, revised", b"x" * 32, axis(5)),
        metadata=None, ttl_seconds=None, embedder="x",
    )  # fmt: skip
    stored = await migrations.store_vectors(
        migration, runner, [(p, target_vector(0)) for p in read], lease_seconds=LEASE
    )
    assert stored is not None
    assert stored.rows_done == 1  # the changed memory's vector was not written
    again = await migrations.pending(replace(stored, cursor=None), limit=10)
    assert [p.content for p in again] == ["fact 0.0, revised"]
    # Once embedded, a tenant's content change clears the target vector again; a metadata change
    # keeps it.
    stored = await migrations.store_vectors(
        stored, runner, [(p, target_vector(0)) for p in again], lease_seconds=LEASE
    )
    assert stored is not None
    assert await migrations.pending(replace(stored, cursor=None), limit=10) == []
    kept = next(p for p in read if p.content == "fact 0.1")
    await memories.update(
        tenant, tenant.buckets[0], kept.id, content=None, metadata={"k": "v"}, ttl_seconds=None, embedder="x"
    )
    await memories.update(
        tenant, tenant.buckets[0], changed.id, content=("fact 0.0, third", b"y" * 32, axis(6)),
        metadata=None, ttl_seconds=None, embedder="x",
    )  # fmt: skip
    assert [p.content for p in await migrations.pending(replace(stored, cursor=None), limit=10)] == [
        "fact 0.0, third"
    ]


async def test_a_write_keeps_target_vectors_only_for_the_migration_backfilling_now(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    """A replica still believing in a cancelled migration cannot leave its target's vectors."""
    agent, tenants = await space_with(memories, buckets=1, per_bucket=1)
    created = await migrations.create(planned(agent))
    assert created is not None
    space = await memories.get_space(Tenant(NAMESPACE, agent))
    assert space is not None
    assert (space.migration_id, space.migrating_to) == (created.id, TARGET)
    tenant = tenants[0]
    both = replace(memory("dual-written", axis(1)), next_embedding=target_vector(1))
    await memories.insert(replace(tenant, dual_write=created.id), tenant.buckets[0], [both])
    stale = replace(
        memory("dual-written for a migration that is gone", axis(2)), next_embedding=target_vector(2)
    )
    await memories.insert(replace(tenant, dual_write=str(uuid.uuid4())), tenant.buckets[0], [stale])
    plain = replace(memory("no migration declared", axis(3)), next_embedding=target_vector(3))
    await memories.insert(tenant, tenant.buckets[0], [plain])
    # Paused, the same migration is no longer backfilling: a write naming it keeps nothing either.
    paused = await migrations.transition(
        created.id, expect=(MigrationState.BACKFILLING,), state=MigrationState.PAUSED
    )
    assert paused is not None
    during_pause = replace(
        memory("dual-written while it was paused", axis(4)), next_embedding=target_vector(0)
    )
    await memories.insert(replace(tenant, dual_write=created.id), tenant.buckets[0], [during_pause])
    await migrations.transition(created.id, expect=(MigrationState.PAUSED,), state=MigrationState.BACKFILLING)
    claimed = await claim(migrations, "runner-g", created.id)
    waiting = {p.content for p in await migrations.pending(claimed, limit=10)}
    assert waiting == {
        "fact 0.0",
        "dual-written for a migration that is gone",
        "no migration declared",
        "dual-written while it was paused",
    }


async def test_one_runner_at_a_time_and_another_takes_over_an_expired_lease(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, _ = await space_with(memories, buckets=1, per_bucket=3)
    created = await migrations.create(planned(agent))
    assert created is not None
    first = await claim(migrations, "runner-1", created.id)
    # A second runner cannot claim it while the lease holds, nor write with it.
    for _ in range(50):
        other = await migrations.claim(
            "runner-2", lease_seconds=LEASE, embedders=[TARGET.name], retire_after_seconds=0
        )
        assert other is None or other.id != created.id
        if other is None:
            break
    batch = await migrations.pending(first, limit=1)
    assert (
        await migrations.store_vectors(first, "runner-2", [(batch[0], target_vector(0))], lease_seconds=LEASE)
        is None
    )
    assert not await migrations.cut_over(first, "runner-2")
    # The first runner's lease expires (a lease of ~0 s): the second takes over and can write.
    # Through the helper: an older migration another test left runnable would be claimed first.
    await claim(migrations, "runner-1", created.id, lease_seconds=0.01)
    await asyncio.sleep(0.05)
    # A runner without the target embedder is never given the backfill, free as it now is.
    for _ in range(50):
        other = await migrations.claim(
            "runner-3", lease_seconds=0.01, embedders=["other"], retire_after_seconds=0
        )
        assert other is None or other.id != created.id
        if other is None:
            break
    second = await claim(migrations, "runner-2", created.id)
    assert second.lease_owner == "runner-2"
    assert await migrations.store_vectors(
        second, "runner-2", [(batch[0], target_vector(0))], lease_seconds=LEASE
    )
    assert (
        await migrations.store_vectors(first, "runner-1", [(batch[0], target_vector(0))], lease_seconds=LEASE)
        is None
    )


async def test_a_runner_is_not_given_again_a_migration_it_says_it_is_driving(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    """A runner drives several migrations at once: its own lease would hand it the oldest one
    again and again, so it names those it drives (`busy`) and gets another or none."""
    agent, _ = await space_with(memories, buckets=1, per_bucket=1)
    created = await migrations.create(planned(agent))
    assert created is not None
    await claim(migrations, "runner-1", created.id)
    again = await migrations.claim(
        "runner-1", lease_seconds=LEASE, embedders=[TARGET.name], retire_after_seconds=0
    )
    assert again is not None
    assert again.id == created.id  # its own lease: renewed
    for _ in range(50):
        other = await migrations.claim(
            "runner-1",
            lease_seconds=LEASE,
            embedders=[TARGET.name],
            retire_after_seconds=0,
            busy=[created.id],
        )
        assert other is None or other.id != created.id
        if other is None:
            break
        await migrations.transition(other.id, expect=[other.state], state=MigrationState.CANCELLED)


async def test_cancel_before_the_cutover_clears_the_target_slot_and_changes_nothing_searched(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, tenants = await space_with(memories, buckets=2, per_bucket=3)
    created = await migrations.create(planned(agent))
    assert created is not None
    runner = "runner-e"
    await backfill(migrations, await claim(migrations, runner, created.id), runner)
    cancelling = await migrations.transition(
        created.id,
        expect=(MigrationState.BACKFILLING, MigrationState.PAUSED),
        state=MigrationState.CANCELLING,
    )
    assert cancelling is not None
    assert cancelling.cursor is None
    assert cancelling.lease_owner is None
    assert (
        await migrations.transition(
            created.id, expect=(MigrationState.BACKFILLING,), state=MigrationState.PAUSED
        )
        is None
    )
    migration = await claim(migrations, runner, created.id)
    cleared = 0
    while (
        result := await migrations.clear_slot(migration, runner, limit=4, lease_seconds=LEASE)
    ) is not None:
        count, migration = result
        if count == 0:
            break
        cleared += count
    assert cleared == 6
    done = await migrations.transition(
        created.id, expect=(MigrationState.CANCELLING,), state=MigrationState.CANCELLED
    )
    assert done is not None
    assert done.finished_at is not None
    space = await memories.get_space(Tenant(NAMESPACE, agent))
    assert space == SPACE  # generation 0, the same embedder
    tenant = tenants[1]
    found = await search(memories, tenant, tenant.buckets[0], vector_query(axis(0), k=10))
    assert len(found) == 3
    # Nothing is left to embed for a new migration's backfill... it starts from nothing again.
    again = await migrations.create(planned(agent))
    assert again is not None
    assert await migrations.pending(again, limit=10) == []  # nobody holds its lease: nothing
    assert len(await migrations.pending(await claim(migrations, runner, again.id), limit=10)) == 6


async def test_a_migration_pauses_after_repeated_failures_and_lists_newest_first(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    agent, _ = await space_with(memories, buckets=1, per_bucket=1)
    created = await migrations.create(planned(agent))
    assert created is not None
    migration = await claim(migrations, "runner-f", created.id)
    first = await migrations.record_failure(migration, "runner-f", "timeout", pause_after=2)
    assert first is not None
    assert first.state is MigrationState.BACKFILLING
    assert first.failures == 1
    second = await migrations.record_failure(migration, "runner-f", "timeout again", pause_after=2)
    assert second is not None
    assert second.state is MigrationState.PAUSED
    assert second.reason == "timeout again"
    assert second.lease_owner is None
    # A paused migration is not claimed; it is still the space's active one.
    assert await migrations.create(planned(agent)) is None
    resumed = await migrations.transition(
        created.id, expect=(MigrationState.PAUSED,), state=MigrationState.BACKFILLING
    )
    assert resumed is not None
    assert resumed.failures == 0
    page = await migrations.page(limit=500, before=None)
    assert created.id in [m.id for m in page]
    stamps = [(m.created_at, m.id) for m in page]
    assert stamps == sorted(stamps, reverse=True)
    assert await migrations.get(str(uuid.uuid4())) is None


async def test_active_lists_the_unfinished_migrations_oldest_first(
    memories: MemoryStore, migrations: EmbeddingMigrationStore
) -> None:
    """What the stall alert's gauges are read from: backfilling, paused, retiring and cancelling
    migrations, never succeeded or cancelled ones."""
    created = []
    for _ in range(3):
        agent, _ = await space_with(memories, buckets=1, per_bucket=2)
        migration = await migrations.create(planned(agent, rows_total=2))
        assert migration is not None
        created.append(migration)
    finished = await migrations.transition(
        created[1].id, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
    )
    assert finished is not None
    paused = await migrations.transition(
        created[2].id, expect=[MigrationState.BACKFILLING], state=MigrationState.PAUSED
    )
    assert paused is not None
    ours = {m.id for m in created}
    active = [m for m in await migrations.active() if m.id in ours]
    assert [(m.id, m.state, m.rows_total) for m in active] == [
        (created[0].id, MigrationState.BACKFILLING, 2),
        (created[2].id, MigrationState.PAUSED, 2),
    ]
    stamps = [(m.created_at, m.id) for m in await migrations.active()]
    assert stamps == sorted(stamps)
    for migration in (created[0], created[2]):
        await migrations.transition(
            migration.id, expect=[migration.state, MigrationState.PAUSED], state=MigrationState.CANCELLED
        )


async def test_the_cutover_is_audited_with_it(backend: Backend) -> None:
    memories, migrations = backend.memories, backend.migrations
    agent, _ = await space_with(memories, buckets=1, per_bucket=2)
    created = await migrations.create(planned(agent))
    assert created is not None
    runner = "runner-h"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    before = await backend.audit.page(before_id=None, kinds=[], since=None, until=None, limit=1000)
    assert not [e for e in before if created.id in e.target]
    assert await migrations.cut_over(migration, runner)
    events = await backend.audit.page(before_id=None, kinds=[], since=None, until=None, limit=1000)
    mine = [e for e in events if created.id in e.target]
    assert [(e.kind, e.action, e.outcome) for e in mine] == [
        ("embedding_migration", "cut over embedding migration", "succeeded")
    ]
    assert f"space:{NAMESPACE}/{agent}" in mine[0].target
