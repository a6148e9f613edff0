"""MemoryStatistics: live memories counted over every tenant, by the pepper version of the bucket
they are in and by the memory space (namespace, agent) that wrote them; expired rows not counted,
versions and spaces without rows absent.

The counts take no tenant (counts only, no rows): they cover buckets no single tenant declares.
PostgreSQL's tables are shared by the whole session, so each test writes under pepper versions and
agents no other test uses and asserts about those only.
"""

from __future__ import annotations

import random

import numpy as np

from tests.storage.conformance.support import (
    NAMESPACE,
    memory,
    new_bucket,
    new_namespace,
    new_tenant,
    random_unit,
)
from tokensvc.storage.ports import MemoryStatistics, MemoryStore
from tokensvc.storage.records import NewMemory, Tenant


def fresh_version() -> int:
    """A pepper version no other test writes under (bucket ids allow nine digits)."""
    return random.randrange(100_000_000, 999_999_000)


def rows(rng: np.random.Generator, label: str, count: int, ttl: int | None = None) -> list[NewMemory]:
    return [memory(f"{label} {i}", random_unit(rng), ttl=ttl) for i in range(count)]


async def counts_of(statistics: MemoryStatistics, *versions: int) -> dict[int, int]:
    by_version = await statistics.rows_by_pepper_version()
    return {v: by_version[v] for v in versions if v in by_version}


async def spaces_of(statistics: MemoryStatistics, *tenants: Tenant) -> dict[tuple[str, str], int]:
    by_space = await statistics.rows_by_space()
    keys = [(t.namespace, t.agent) for t in tenants]
    return {key: by_space[key] for key in keys if key in by_space}


async def test_live_memories_are_counted_by_the_pepper_version_of_their_bucket_across_tenants(
    memories: MemoryStore, statistics: MemoryStatistics, rng: np.random.Generator
) -> None:
    version = fresh_version()
    alice, bob, newer = new_bucket(version), new_bucket(version), new_bucket(version + 1)
    first, second = new_tenant(alice, newer), new_tenant(bob)
    assert await counts_of(statistics, version, version + 1) == {}

    await memories.insert(first, alice, rows(rng, "alice", 3))
    await memories.insert(second, bob, rows(rng, "bob", 2))
    await memories.insert(first, newer, rows(rng, "newer", 1))

    assert await counts_of(statistics, version, version + 1) == {version: 5, version + 1: 1}
    assert all(isinstance(n, int) for n in (await statistics.rows_by_pepper_version()).values())


async def test_live_memories_are_counted_by_the_space_that_wrote_them(
    memories: MemoryStore, statistics: MemoryStatistics, rng: np.random.Generator
) -> None:
    helper_bucket, planner_bucket, shared_bucket = new_bucket(), new_bucket(), new_bucket()
    helper, planner = new_tenant(helper_bucket, shared_bucket), new_tenant(planner_bucket)
    elsewhere = Tenant(new_namespace(), helper.agent, (new_bucket(),))
    assert await spaces_of(statistics, helper, planner, elsewhere) == {}

    await memories.insert(helper, helper_bucket, rows(rng, "helper", 2))
    await memories.insert(helper, shared_bucket, rows(rng, "helper, agent-wide", 2))
    await memories.insert(planner, planner_bucket, rows(rng, "planner", 3))
    await memories.insert(elsewhere, elsewhere.buckets[0], rows(rng, "same agent name", 1))

    assert await spaces_of(statistics, helper, planner, elsewhere) == {
        (NAMESPACE, helper.agent): 4,
        (NAMESPACE, planner.agent): 3,
        (elsewhere.namespace, helper.agent): 1,
    }


async def test_expired_memories_are_not_counted(
    memories: MemoryStore, statistics: MemoryStatistics, rng: np.random.Generator
) -> None:
    version = fresh_version()
    bucket = new_bucket(version)
    tenant = new_tenant(bucket)
    live = rows(rng, "live", 2) + rows(rng, "for an hour", 1, ttl=3600)
    await memories.insert(tenant, bucket, [*live, *rows(rng, "expired", 3, ttl=0)])

    assert await counts_of(statistics, version) == {version: 3}
    assert await spaces_of(statistics, tenant) == {(NAMESPACE, tenant.agent): 3}

    # An update that expires a memory takes it out of the counts too.
    await memories.update(
        tenant, bucket, live[0].id, content=None, metadata=None, ttl_seconds=0, embedder="test"
    )
    assert await counts_of(statistics, version) == {version: 2}
    assert await spaces_of(statistics, tenant) == {(NAMESPACE, tenant.agent): 2}


async def test_a_version_or_space_whose_memories_are_gone_is_absent(
    memories: MemoryStore, statistics: MemoryStatistics, rng: np.random.Generator
) -> None:
    version = fresh_version()
    bucket = new_bucket(version)
    tenant = new_tenant(bucket)
    stored = rows(rng, "soon gone", 3)
    await memories.insert(tenant, bucket, stored)
    await memories.delete(tenant, bucket, [stored[0].id])
    assert await counts_of(statistics, version) == {version: 2}

    await memories.delete_all(tenant, bucket)

    assert await counts_of(statistics, version) == {}
    assert await spaces_of(statistics, tenant) == {}
    await memories.insert(tenant, bucket, rows(rng, "expired at once", 2, ttl=0))
    assert await counts_of(statistics, version) == {}
    assert await spaces_of(statistics, tenant) == {}


async def test_moved_memories_count_for_their_new_pepper_version_and_the_same_space(
    memories: MemoryStore, statistics: MemoryStatistics, rng: np.random.Generator
) -> None:
    version = fresh_version()
    old, current = new_bucket(version), new_bucket(version + 1)
    tenant = new_tenant(current, old)
    await memories.insert(tenant, old, rows(rng, "remembered under the old pepper", 3))
    await memories.insert(tenant, current, rows(rng, "remembered under the new pepper", 1))
    assert await counts_of(statistics, version, version + 1) == {version: 3, version + 1: 1}

    assert await memories.move_buckets(tenant, current, [old]) == 3

    assert await counts_of(statistics, version, version + 1) == {version + 1: 4}
    assert await spaces_of(statistics, tenant) == {(NAMESPACE, tenant.agent): 4}
