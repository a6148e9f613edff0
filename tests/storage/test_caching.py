"""The caching store decorators: a second read is served without the wrapped store, and what made
an entry stale forgets it (on the in-process stores: no database).

The wrapped store is watched by `Watched`, which forwards every call and notes its name and
keyword arguments, so "served from the cache" means the wrapped store saw no call at all.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, cast

import pytest

from tests.storage.conformance.support import (
    SPACE,
    axis,
    create_base,
    launcher,
    management,
    memory,
    new_bucket,
    new_namespace,
    new_tenant,
    text_query,
    upload,
    vector_query,
)
from tokensvc.errors import ConcurrentChange
from tokensvc.storage.caching import CachingKnowledgeStore, CachingMemoryStore
from tokensvc.storage.inprocess import InProcessKnowledgeStore, InProcessMemoryStore
from tokensvc.storage.ports import KnowledgeStore, MemoryStore, StaleKnowledgeBases, StaleMemorySpace
from tokensvc.storage.records import CandidateQuery, Tenant


class Watched:
    """Forwards every method call to `store`, noting (name, keyword arguments) in `calls`; a call
    named in `failing` raises that exception instead."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.failing: dict[str, Exception] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.store, name)

        async def watched(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            if name in self.failing:
                raise self.failing.pop(name)
            return await method(*args, **kwargs)

        return watched

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def take(self) -> list[str]:
        names = self.names()
        self.calls.clear()
        return names


class Clock:
    """`time.monotonic` for the caches, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


# --- memory spaces' pins -----------------------------------------------------------------------


@pytest.fixture
def memories() -> Watched:
    return Watched(InProcessMemoryStore())


def cached_memories(watched: Watched, clock: Clock, *, pin_seconds: float = 5.0) -> MemoryStore:
    return CachingMemoryStore(
        cast(MemoryStore, watched), pin_seconds=pin_seconds, row_count_seconds=30.0, clock=clock
    )


async def test_a_pinned_space_is_read_once_until_its_time_is_up(memories: Watched, clock: Clock) -> None:
    store = cached_memories(memories, clock, pin_seconds=5.0)
    tenant = new_tenant(new_bucket())
    assert await store.get_space(tenant) is None
    assert await store.get_space(tenant) is None  # not pinned yet: asked every time
    assert memories.take() == ["get_space", "get_space"]

    assert await store.pin_space(tenant, SPACE) == SPACE
    assert await store.get_space(tenant) == SPACE
    clock.now += 4.9
    assert await store.get_space(tenant) == SPACE
    assert memories.take() == ["pin_space"], "the pin is served without the wrapped store"

    clock.now += 0.2
    assert await store.get_space(tenant) == SPACE
    assert memories.take() == ["get_space"]
    other = new_tenant(new_bucket())
    assert await store.get_space(other) is None  # another agent's space is its own entry
    assert memories.take() == ["get_space"]


async def test_a_write_refused_as_stale_forgets_the_pin(memories: Watched, clock: Clock) -> None:
    store = cached_memories(memories, clock)
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    memories.take()

    # The space's generation is 0: a write declaring generation 1 embedded for a cutover that
    # never happened, and the in-process store refuses it like PostgreSQL's trigger does.
    with pytest.raises(StaleMemorySpace):
        await store.insert(dataclasses.replace(tenant, generation=1), bucket, [memory("x", axis(0))])
    assert await store.get_space(tenant) == SPACE
    assert memories.take() == ["insert", "get_space"], "the pin was read again"
    assert await store.get_space(tenant) == SPACE
    assert memories.take() == []


async def test_a_write_rolled_back_for_a_conflict_forgets_the_pin(memories: Watched, clock: Clock) -> None:
    store = cached_memories(memories, clock)
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    memories.failing["insert"] = ConcurrentChange("deadlock detected")

    with pytest.raises(ConcurrentChange):
        await store.insert(tenant, bucket, [memory("x", axis(0))])
    memories.take()
    await store.get_space(tenant)
    assert memories.take() == ["get_space"]


# --- row counts ----------------------------------------------------------------------------------


def counting_plan(seen: list[int]) -> Callable[[int], CandidateQuery]:
    def plan(rows: int) -> CandidateQuery:
        seen.append(rows)
        return text_query("fact", k=10, row_count=rows)

    return plan


async def test_a_bucket_is_counted_once_and_writes_through_the_decorator_adjust_its_count(
    memories: Watched, clock: Clock
) -> None:
    store = cached_memories(memories, clock)
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    stored = await store.insert(tenant, bucket, [memory(f"fact {i}", axis(i)) for i in range(3)])
    memories.take()
    seen: list[int] = []

    async def search() -> int:
        outcome = await store.search(
            tenant, bucket, counting_plan(seen), count_cap=100, filter_=None, embedder="test"
        )
        return outcome.row_count

    def given() -> list[Any]:
        """The row counts the decorator handed the wrapped store's searches (None: count)."""
        counts = [kwargs["row_count"] for name, kwargs in memories.calls if name == "search"]
        memories.calls.clear()
        return counts

    assert [await search(), await search()] == [3, 3]
    assert given() == [None, 3], "the second search was given the count: the store counted once"
    assert seen == [3, 3]

    await store.insert(tenant, bucket, [memory("fact 3", axis(3)), memory("fact 0", axis(0))])  # 1 new
    await search()
    await store.delete(tenant, bucket, [stored[0].id, stored[1].id])
    await search()
    assert given() == [4, 2]

    clock.now += 30.1  # other replicas' writes are seen when the count is read again
    await search()
    await search()
    assert given() == [None, 2]


async def test_emptying_a_bucket_or_moving_rows_into_it_forgets_its_count(
    memories: Watched, clock: Clock
) -> None:
    store = cached_memories(memories, clock)
    old, bucket = new_bucket(), new_bucket(pepper_version=2)
    tenant = Tenant("conformance", new_tenant().agent, (bucket, old))
    await store.pin_space(tenant, SPACE)
    await store.insert(tenant, old, [memory("moved", axis(1))])
    await store.insert(tenant, bucket, [memory("stays", axis(0))])
    plan = counting_plan([])

    async def counted() -> Any:
        await store.search(tenant, bucket, plan, count_cap=100, filter_=None, embedder="test")
        return next(kw["row_count"] for name, kw in reversed(memories.calls) if name == "search")

    assert await counted() is None
    assert await counted() == 1
    await store.move_buckets(tenant, bucket, [old])
    assert await counted() is None, "rows moved in: counted again"
    assert await counted() == 2
    await store.delete_all(tenant, bucket)
    assert await counted() is None, "emptied: counted again"


# --- knowledge bases ---------------------------------------------------------------------------


@pytest.fixture
def knowledge() -> Watched:
    return Watched(InProcessKnowledgeStore())


def cached_knowledge(watched: Watched, clock: Clock) -> KnowledgeStore:
    return CachingKnowledgeStore(cast(KnowledgeStore, watched), seconds=30.0, clock=clock)


async def test_a_searchs_bases_are_read_once_and_then_answered_with_the_pins_to_check(
    knowledge: Watched, clock: Clock
) -> None:
    store = cached_knowledge(knowledge, clock)
    ns = new_namespace()
    kb = await create_base(store, ns, "kb")
    tenant = launcher(ns, "kb", "absent")
    knowledge.take()

    first, unchecked = await store.bases_for_search(tenant, ["kb", "absent"])
    again, pins = await store.bases_for_search(tenant, ["kb", "absent"])

    assert knowledge.take() == ["bases_for_search"]
    assert first == again == [kb]
    assert unchecked is None
    assert pins is not None
    assert (pins.roster, pins.created) == (("kb", "absent"), (("kb", kb.created_at, 0),))
    assert (await store.get_bases(tenant, ["kb"]))[0].document_count == 0
    assert knowledge.take() == ["get_bases"], "management reads are never cached"
    clock.now += 30.1
    assert (await store.bases_for_search(tenant, ["kb", "absent"]))[1] is None
    assert knowledge.take() == ["bases_for_search"]


async def test_a_search_whose_pins_fail_their_check_forgets_them(knowledge: Watched, clock: Clock) -> None:
    store = cached_knowledge(knowledge, clock)
    ns = new_namespace()
    await create_base(store, ns, "kb")
    await upload(store, ns, "kb", "doc", ["some text"])
    tenant = launcher(ns, "kb", "later")
    await store.bases_for_search(tenant, ["kb", "later"])
    bases, pins = await store.bases_for_search(tenant, ["kb", "later"])
    # Another replica creates a base of the roster: the remembered pins no longer hold.
    await cast(KnowledgeStore, knowledge.store).create_base(
        management(ns), dataclasses.replace(bases[0], ref="later")
    )

    with pytest.raises(StaleKnowledgeBases):
        await store.search(
            tenant,
            ["kb"],
            lambda _rows: vector_query(axis(0), k=5),
            count_cap=10,
            filter_=None,
            generations=[0],
            expect=pins,
        )
    fresh, unchecked = await store.bases_for_search(tenant, ["kb", "later"])
    assert [b.ref for b in fresh] == ["kb", "later"]
    assert unchecked is None, "read afresh: its search checks nothing"


@pytest.mark.parametrize("change", ["create", "delete"])
async def test_creating_or_deleting_a_base_forgets_every_searchs_bases(
    knowledge: Watched, clock: Clock, change: str
) -> None:
    store = cached_knowledge(knowledge, clock)
    ns = new_namespace()
    kb = await create_base(store, ns, "kb")
    tenant = launcher(ns, "kb")
    await store.bases_for_search(tenant, ["kb"])
    assert (await store.bases_for_search(tenant, ["kb"]))[1] is not None
    await create_base(store, ns, "kb")  # exists already: nothing created, nothing forgotten
    assert (await store.bases_for_search(tenant, ["kb"]))[1] is not None

    if change == "create":
        await store.create_base(management(ns), dataclasses.replace(kb, ref="other"))
    else:
        await store.delete_base(management(ns), "other-absent")  # even a delete that found nothing
    knowledge.take()
    assert (await store.bases_for_search(tenant, ["kb"]))[1] is None
    assert knowledge.take() == ["bases_for_search"]


async def test_the_searched_bases_are_counted_once(knowledge: Watched, clock: Clock) -> None:
    store = cached_knowledge(knowledge, clock)
    ns = new_namespace()
    for kb in ("kb-a", "kb-b"):
        await create_base(store, ns, kb)
        await upload(store, ns, kb, "doc", ["one fact", "two facts"])
    tenant = launcher(ns, "kb-a", "kb-b")
    seen: list[int] = []
    searches = itertools.product([["kb-a", "kb-b"], ["kb-a"]], range(2))
    for refs, _ in searches:
        await store.search(
            tenant, refs, counting_plan(seen), count_cap=100, filter_=None, generations=[0] * len(refs)
        )
    given = [kw["row_count"] for name, kw in knowledge.calls if name == "search"]
    assert given == [None, 4, None, 2], "each set of searched bases is counted once"
    assert seen == [4, 4, 2, 2]
