"""The gauges the alerts read that do not come from RPCs: what the background refresh reads from
the stores (open credential rotations, unfinished migrations, memories per space) and the
expired-memory sweeper's success stamp. In-process stores; tests/monitoring/test_prometheus.py
scrapes the same gauges from a real service on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from prometheus_client import REGISTRY

from tests.storage.conformance.support import NAMESPACE, SPACE, axis, memory, new_bucket
from tokensvc.embedders import EmbedderRegistry, EmbedderSpec, HashEmbedder
from tokensvc.memory.service import LongTermMemory
from tokensvc.storage.inprocess.credentials import InProcessCredentialJournal
from tokensvc.storage.inprocess.memories import InProcessMemoryStatistics, InProcessMemoryStore
from tokensvc.storage.inprocess.reembedding import InProcessEmbeddingMigrationStore
from tokensvc.storage.records import Tenant
from tokensvc.storage.reembedding_records import MemorySpaceMigration, MigrationState
from tokensvc.supervision import read_database_gauges, sweep_forever


def planned(agent: str) -> MemorySpaceMigration:
    return MemorySpaceMigration(
        id=str(uuid.uuid4()),
        namespace=NAMESPACE,
        agent=agent,
        from_generation=0,
        rows_total=3,  # the space's count (space_size), as the domain passes it
        source=SPACE.embedder,
        target=EmbedderSpec("target", "target-model", 4, True),
        state=MigrationState.BACKFILLING,
        created_by="spiffe://test/admin",
    )


async def test_the_readings_count_open_rotations_and_list_only_unfinished_migrations() -> None:
    memories = InProcessMemoryStore()
    journal, runner_journal = InProcessCredentialJournal(), InProcessCredentialJournal()
    journals = [journal, runner_journal]
    migrations = InProcessEmbeddingMigrationStore(memories)
    agents = [f"agent-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for agent in agents:
        tenant = Tenant(NAMESPACE, agent, (new_bucket(),), generation=0)
        await memories.pin_space(Tenant(NAMESPACE, agent), SPACE)
        await memories.insert(tenant, tenant.buckets[0], [memory(f"fact {i}", axis(i % 4)) for i in range(3)])

    empty = await read_database_gauges(InProcessMemoryStatistics(memories), journals, migrations)
    assert (empty.open_rotations, empty.oldest_open_rotation_started, empty.migrations) == (0, 0.0, ())
    assert empty.memories_per_space == {(NAMESPACE, agents[0]): 3, (NAMESPACE, agents[1]): 3}

    before = time.time()
    first = await journal.begin(mode="rotate", actor="a", from_role="tokensvc_a", to_role="tokensvc_b")
    # The runner's credential keeps a journal of its own; both count.
    await runner_journal.begin(mode="reload", actor="a", from_role="runner_a", to_role="runner_a")
    running = await migrations.create(planned(agents[0]))
    cancelled = await migrations.create(planned(agents[1]))
    assert running is not None
    assert cancelled is not None
    await migrations.transition(
        cancelled.id, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED
    )

    readings = await read_database_gauges(InProcessMemoryStatistics(memories), journals, migrations)
    assert readings.open_rotations == 2
    assert before - 1 <= readings.oldest_open_rotation_started <= time.time()
    assert [(m.id, m.kind, m.state, m.rows_total) for m in readings.migrations] == [
        (running.id, "memory_space", "backfilling", 3)
    ]

    await journal.close(first, outcome="failed", reason="test")
    later = await read_database_gauges(InProcessMemoryStatistics(memories), journals, migrations)
    assert later.open_rotations == 1


async def test_the_sweeper_stamps_each_successful_sweep_and_counts_failures() -> None:
    class FailingOnce(InProcessMemoryStore):
        failed = False

        async def sweep_expired(self, limit: int = 1000) -> int:
            if not self.failed:
                self.failed = True
                raise OSError("database unreachable")
            return await super().sweep_expired(limit)

    memory_service = LongTermMemory(
        FailingOnce(), EmbedderRegistry({"hash": HashEmbedder()}), default_embedder="hash"
    )

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    failed = sample("tokensvc_memory_sweeps_total", outcome="failed")
    succeeded = sample("tokensvc_memory_sweeps_total", outcome="succeeded")
    started = time.time()
    sweeper = asyncio.create_task(sweep_forever(memory_service, 0.05))
    try:
        for _ in range(200):
            await asyncio.sleep(0.02)
            if sample("tokensvc_memory_sweeps_total", outcome="succeeded") > succeeded:
                break
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
    assert sample("tokensvc_memory_sweeps_total", outcome="failed") == failed + 1
    assert sample("tokensvc_memory_sweeps_total", outcome="succeeded") >= succeeded + 1
    assert sample("tokensvc_memory_sweep_interval_seconds") == 0.05
    # Stamped after the failure, by the sweep that succeeded.
    assert sample("tokensvc_memory_sweep_last_success_timestamp_seconds") >= started + 0.05
