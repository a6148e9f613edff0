"""DataSubjectStore against every implementation: it lists memory spaces across agents, and
erases and exports the rows of the buckets a tenant declares, never another's."""

from __future__ import annotations

import uuid

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.support import SPACE, axis, memory, new_bucket, new_namespace
from tokensvc.storage.records import AgentMemories, DataSubjectReceipt, ReceiptKind, Tenant


async def space(backend: Backend, namespace: str, agent: str, buckets: dict[str, int]) -> None:
    """`agent`'s space in `namespace` with buckets of this many memories each."""
    await backend.memories.pin_space(Tenant(namespace, agent), SPACE)
    for bucket, count in buckets.items():
        tenant = Tenant(namespace, agent, (bucket,))
        await backend.memories.insert(
            tenant, bucket, [memory(f"{bucket} fact {i}", axis(i)) for i in range(count)]
        )


async def test_spaces_are_listed_by_namespace_in_order_after_a_cursor(backend: Backend) -> None:
    ns, other = new_namespace(), new_namespace()
    for agent in ("b-agent", "a-agent", "c-agent"):
        await space(backend, ns, agent, {})
    await space(backend, other, "a-agent", {})
    store = backend.data_subjects
    assert await store.agents(ns, after=None, limit=10) == [(ns, "a-agent"), (ns, "b-agent"), (ns, "c-agent")]
    assert await store.agents(ns, after=(ns, "a-agent"), limit=1) == [(ns, "b-agent")]
    everywhere = await store.agents(None, after=None, limit=10_000)
    assert {(ns, "a-agent"), (other, "a-agent")} <= set(everywhere)
    assert everywhere == sorted(everywhere)


async def test_erase_deletes_the_declared_buckets_in_batches_and_nothing_else(backend: Backend) -> None:
    ns = new_namespace()
    mine_old, mine_new, theirs = new_bucket(1), new_bucket(2), new_bucket(2)
    await space(backend, ns, "agent", {mine_old: 3, mine_new: 4, theirs: 2})
    user = Tenant(ns, "agent", (mine_new, mine_old))
    store = backend.data_subjects
    batches = []
    while erased := await store.erase(user, limit=3):
        batches.append(erased)
    assert batches == [3, 3, 1]
    assert await store.erase(user, limit=3) == 0
    assert await store.export(user, after=None, limit=100) == []
    left = await store.export(Tenant(ns, "agent", (theirs,)), after=None, limit=100)
    assert sorted(e.memory.content for e in left) == [f"{theirs} fact 0", f"{theirs} fact 1"]


async def test_export_lists_live_rows_in_a_stable_order_that_resumes(backend: Backend) -> None:
    ns = new_namespace()
    first, second = sorted([new_bucket(1), new_bucket(2)])
    await space(backend, ns, "agent", {first: 3, second: 2})
    user = Tenant(ns, "agent", (second, first))
    store = backend.data_subjects
    everything = await store.export(user, after=None, limit=100)
    assert [e.bucket for e in everything] == [first] * 3 + [second] * 2
    assert {(e.namespace, e.agent) for e in everything} == {(ns, "agent")}
    keys = [(e.bucket, e.memory.created_at, e.memory.id) for e in everything]
    assert keys == sorted(keys)
    resumed = await store.export(user, after=keys[1], limit=2)
    assert [e.memory.id for e in resumed] == [e.memory.id for e in everything[2:4]]
    assert {e.memory.content for e in everything} == {
        f"{b} fact {i}" for b, n in ((first, 3), (second, 2)) for i in range(n)
    }


async def test_receipts_are_kept_as_recorded(backend: Backend) -> None:
    store = backend.data_subjects
    recorded = await store.record_receipt(
        DataSubjectReceipt(
            id=str(uuid.uuid4()),
            kind=ReceiptKind.ERASURE,
            namespace="",
            memories=7,
            per_agent=(AgentMemories("ns-a", "agent-1", 4), AgentMemories("ns-b", "agent-2", 3)),
            agents=5,
            key_prefixes=10,
            actor="spiffe://test/control-plane",
        )
    )
    assert recorded.created_at is not None
    assert await store.receipt(recorded.id) == recorded
    assert await store.receipt(str(uuid.uuid4())) is None
