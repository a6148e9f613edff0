"""LongTermMemory's business rules on the in-process store: no database, the `hash` embedder.

The store's own contract is the conformance suite's (tests/storage/conformance); these tests pin
what the domain adds on top: the scope gate, pinning, content normalisation and dedupe ids,
idempotency keys, all-or-nothing batches, pepper re-bucketing, search modes, top_k, min_score,
updates, TTLs. The API tests (tests/api) check the same service end to end over PostgreSQL.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from tests.retrieval.engine_support import RecordingEngine
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import EmbedderRegistry, EmbedderSpec, HashEmbedder
from tokensvc.errors import (
    AlreadyExists,
    ConcurrentChange,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PinnedConfiguration,
    Reason,
)
from tokensvc.memory import Condition, Operator
from tokensvc.memory.models import NewMemory
from tokensvc.memory.paging import PageCursor
from tokensvc.memory.service import LongTermMemory, RememberItem, SearchMode, SearchQuery
from tokensvc.storage.inprocess import InProcessMemoryStore
from tokensvc.storage.records import MemorySpace, StoredRef, Tenant


class MovableClock:
    """Wall-clock time that a test moves forward."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def bucket(version: int = 1) -> str:
    return f"v{version}." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")


def scope_for(
    current: str | None = None, *previous: str, agent: str = "helper", long_term_memory: bool = True
) -> TenantScope:
    current = current or bucket(len(previous) + 1)
    return TenantScope(
        namespace="team-a",
        agent=agent,
        bucket_id=current,
        previous_bucket_ids=previous,
        agent_bucket_id=current,
        per_user=True,
        registry=None,
        long_term_memory=long_term_memory,
        knowledge_bases=(),
        run_id="run-1",
        jti="jti-1",
        issued_at=0,
        expires_at=0,
    )


def item(
    content: str, *, key: str | None = None, ttl: int | None = None, **metadata: str | float | bool
) -> RememberItem:
    return RememberItem(content=content, metadata=dict(metadata), idempotency_key=key, ttl_seconds=ttl)


def query(
    text: str | None,
    *,
    mode: SearchMode = SearchMode.HYBRID,
    top_k: int = 10,
    min_score: float | None = None,
    vector: np.ndarray | None = None,
    filter_: Condition | None = None,
) -> SearchQuery:
    return SearchQuery(text=text, vector=vector, top_k=top_k, min_score=min_score, filter=filter_, mode=mode)


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


@pytest.fixture
def store(clock: MovableClock) -> InProcessMemoryStore:
    return InProcessMemoryStore(clock=clock)


@pytest.fixture
def hashing() -> EmbedderRegistry:
    return EmbedderRegistry({"hash": HashEmbedder()})


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


@pytest.fixture
def ltm(store: InProcessMemoryStore, hashing: EmbedderRegistry, engine: RecordingEngine) -> LongTermMemory:
    return LongTermMemory(store, hashing, default_embedder="hash", engine=engine)


@pytest.fixture
def scope() -> TenantScope:
    return scope_for()


# --- scope and pinning ------------------------------------------------------------------------


async def test_a_capability_without_long_term_memory_is_refused_everywhere(ltm: LongTermMemory) -> None:
    denied = scope_for(long_term_memory=False)

    for call in (
        ltm.remember(denied, [item("x")]),
        ltm.get(denied, "00000000-0000-0000-0000-000000000000"),
        ltm.search(denied, query("x")),
        ltm.forget_all(denied),
    ):
        with pytest.raises(PermissionDenied):
            await call


async def test_the_first_write_pins_the_default_embedder_and_text_config(
    ltm: LongTermMemory, store: InProcessMemoryStore, scope: TenantScope
) -> None:
    tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id,))
    assert await ltm.search(scope, query("anything")) == [], "reads never pin"
    assert await store.get_space(tenant) is None

    await ltm.remember(scope, [item("the first memory")])

    assert await store.get_space(tenant) == MemorySpace(HashEmbedder().spec, "english")


async def test_a_space_pinned_to_a_differently_configured_embedder_is_refused(
    store: InProcessMemoryStore, scope: TenantScope
) -> None:
    tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id,))
    await store.pin_space(tenant, MemorySpace(HashEmbedder(dimension=384).spec, "english"))
    drifted = LongTermMemory(
        store, EmbedderRegistry({"hash": HashEmbedder(dimension=256)}), default_embedder="hash"
    )

    with pytest.raises(PinnedConfiguration):
        await drifted.remember(scope, [item("a memory")])
    with pytest.raises(PinnedConfiguration):
        await drifted.search(scope, query("a memory"))


async def test_a_space_pinned_to_an_embedder_no_longer_configured_still_serves_reads(
    store: InProcessMemoryStore, hashing: EmbedderRegistry, scope: TenantScope
) -> None:
    tenant = Tenant(scope.namespace, scope.agent, (scope.bucket_id,))
    gone = EmbedderSpec("retired", "retired-model", 384, True)
    await store.pin_space(tenant, MemorySpace(gone, "english"))
    ltm = LongTermMemory(store, hashing, default_embedder="hash")

    with pytest.raises(PinnedConfiguration):
        await ltm.remember(scope, [item("needs the retired embedder")])
    with pytest.raises(PinnedConfiguration):
        await ltm.search(scope, query("needs an embedding", mode=SearchMode.VECTOR))
    assert await ltm.search(scope, query("text mode needs none", mode=SearchMode.TEXT)) == []
    assert await ltm.list_page(scope, page_size=10, cursor=None, filter_=None) == ([], None)


# --- remember ---------------------------------------------------------------------------------


async def test_remember_returns_one_id_per_item_in_order_and_dedupes_normalised_content(
    ltm: LongTermMemory, scope: TenantScope
) -> None:
    # "e" + COMBINING ACUTE is NFC "é"; surrounding whitespace is trimmed.
    first = await ltm.remember(scope, [item("café au lait"), item("tea"), item("  cafe\u0301 au lait \n")])

    assert [dedup for _, dedup in first] == [False, False, True]
    assert first[2][0] == first[0][0], "a repeat within the batch gets its first's id"
    again = await ltm.remember(scope, [item("tea"), item("water")])
    assert again[0] == (first[1][0], True)
    assert again[1][1] is False
    stored = await ltm.get(scope, first[0][0])
    assert stored.content == "café au lait"


async def test_an_idempotency_key_returns_its_memory_and_refuses_other_content(
    ltm: LongTermMemory, scope: TenantScope
) -> None:
    [(memory_id, _)] = await ltm.remember(scope, [item("pay the rent", key="req-1")])

    assert await ltm.remember(scope, [item("pay the rent", key="req-1")]) == [(memory_id, True)]
    with pytest.raises(AlreadyExists) as raised:
        await ltm.remember(scope, [item("fresh and new"), item("feed the cat", key="req-1")])
    assert raised.value.field == "items[1].idempotency_key"
    with pytest.raises(AlreadyExists) as within:
        await ltm.remember(scope, [item("one", key="k"), item("two", key="k")])
    assert within.value.field == "items[1].idempotency_key"

    page, _ = await ltm.list_page(scope, page_size=10, cursor=None, filter_=None)
    assert [record.content for record in page] == ["pay the rent"], "a refused batch stores nothing"


async def test_a_batch_refused_by_the_store_stores_nothing(
    ltm: LongTermMemory, store: InProcessMemoryStore, scope: TenantScope, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ltm.remember(scope, [item("warm up the space"), item("taken meanwhile", key="race")])

    # The key is taken after the domain looked (as by a concurrent writer): the store refuses.
    async def blind_find(*args: object) -> list[StoredRef]:
        return []

    monkeypatch.setattr(store, "find_existing", blind_find)
    with pytest.raises(AlreadyExists):
        await ltm.remember(scope, [item("new one"), item("lost the race", key="race")])
    monkeypatch.undo()

    page, _ = await ltm.list_page(scope, page_size=10, cursor=None, filter_=None)
    assert sorted(record.content for record in page) == ["taken meanwhile", "warm up the space"]


# --- pepper rotation --------------------------------------------------------------------------


async def test_rows_under_older_pepper_buckets_move_to_the_current_one_on_first_access(
    store: InProcessMemoryStore, hashing: EmbedderRegistry
) -> None:
    oldest, older, current = bucket(1), bucket(2), bucket(3)
    before = LongTermMemory(store, hashing, default_embedder="hash")
    [(kept, _)] = await before.remember(scope_for(oldest), [item("from the oldest pepper")])
    [(moved, _), (duplicate, _)] = await before.remember(
        scope_for(older, oldest), [item("from the older pepper"), item("also in current")]
    )
    rotated = LongTermMemory(store, hashing, default_embedder="hash")
    [(current_copy, _)] = await LongTermMemory(store, hashing, default_embedder="hash").remember(
        scope_for(current), [item("also in current")]
    )

    scope = scope_for(current, older, oldest)
    page, _ = await rotated.list_page(scope, page_size=10, cursor=None, filter_=None)

    assert {record.id for record in page} == {kept, moved, current_copy}
    assert duplicate not in {record.id for record in page}, "a duplicate of a current row is dropped"
    assert (await rotated.get(scope, kept)).content == "from the oldest pepper"
    old_page, _ = await rotated.list_page(scope_for(older), page_size=10, cursor=None, filter_=None)
    assert old_page == []


async def test_a_bucket_is_moved_once_per_process(
    store: InProcessMemoryStore, hashing: EmbedderRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, current = bucket(1), bucket(2)
    ltm = LongTermMemory(store, hashing, default_embedder="hash")
    moves: list[tuple[str, tuple[str, ...]]] = []
    real_move = store.move_buckets

    async def counted_move(tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        moves.append((target, tuple(sources)))
        return await real_move(tenant, target, sources)

    monkeypatch.setattr(store, "move_buckets", counted_move)
    scope = scope_for(current, older)
    await ltm.remember(scope, [item("one")])
    await ltm.search(scope, query("one"))
    await ltm.list_page(scope, page_size=5, cursor=None, filter_=None)

    assert moves == [(current, (older,))]


# --- search -----------------------------------------------------------------------------------

FACTS = [
    "the user prefers french roast coffee",
    "the user lives in lisbon",
    "the user has a cat called pixel",
    "coffee meetings happen on fridays",
    "the office is in the old harbour",
]


@pytest.fixture
async def facts(ltm: LongTermMemory, scope: TenantScope) -> dict[str, str]:
    """FACTS remembered, content by id."""
    ids = await ltm.remember(
        scope, [item(text, topic="coffee" if "coffee" in text else "other") for text in FACTS]
    )
    return {memory_id: text for (memory_id, _), text in zip(ids, FACTS, strict=True)}


async def test_vector_search_ranks_by_cosine_of_the_hash_embeddings(
    ltm: LongTermMemory, scope: TenantScope, facts: dict[str, str]
) -> None:
    embedder = HashEmbedder()
    question = "which coffee does the user prefer"
    q = (await embedder.embed_query(question)).astype(np.float64)
    cosines = {
        i: float(np.dot((await embedder.embed_query(t)).astype(np.float64), q)) for i, t in facts.items()
    }

    hits = await ltm.search(scope, query(question, mode=SearchMode.VECTOR, top_k=3))

    assert [hit.item.id for hit in hits] == sorted(cosines, key=lambda i: -cosines[i])[:3]
    assert [hit.score for hit in hits] == pytest.approx([cosines[hit.item.id] for hit in hits], abs=1e-5)
    assert all((hit.vector_rank, hit.text_rank) == (0, 0) for hit in hits), "VECTOR mode reports no ranks"


async def test_text_search_returns_only_rows_sharing_a_word_ranked_by_bm25(
    ltm: LongTermMemory, scope: TenantScope, facts: dict[str, str]
) -> None:
    hits = await ltm.search(scope, query("Coffee?", mode=SearchMode.TEXT))

    assert {facts[hit.item.id] for hit in hits} == {FACTS[0], FACTS[3]}
    assert [hit.text_rank for hit in hits] == [1, 2]
    assert hits[0].score >= hits[1].score > 0
    assert await ltm.search(scope, query("zebra", mode=SearchMode.TEXT)) == []


async def test_hybrid_search_fuses_both_rankers_and_reports_their_ranks(
    ltm: LongTermMemory, scope: TenantScope, facts: dict[str, str]
) -> None:
    hits = await ltm.search(scope, query("pixel", top_k=5))

    assert facts[hits[0].item.id] == FACTS[2], "the only row with the rare word wins"
    assert hits[0].text_rank == 1
    assert all(0.0 <= hit.score <= 1.0 for hit in hits)
    assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
    assert sum(1 for hit in hits if hit.text_rank == 0) >= 1, "vector-only candidates come along"


@pytest.mark.parametrize("mode", list(SearchMode))
async def test_top_k_min_score_and_filters_bound_the_results(
    ltm: LongTermMemory, scope: TenantScope, facts: dict[str, str], mode: SearchMode
) -> None:
    everything = await ltm.search(scope, query("the user coffee", mode=mode))
    assert len(everything) >= 2

    assert await ltm.search(scope, query("the user coffee", mode=mode, top_k=1)) == everything[:1]
    floor = everything[1].score
    above = await ltm.search(scope, query("the user coffee", mode=mode, min_score=floor))
    assert above == [hit for hit in everything if hit.score >= floor]
    coffee = await ltm.search(
        scope, query("the user coffee", mode=mode, filter_=Condition("topic", Operator.EQ, "coffee"))
    )
    assert coffee
    assert {facts[hit.item.id] for hit in coffee} <= {FACTS[0], FACTS[3]}


async def test_a_query_vector_must_have_the_pinned_dimension(
    ltm: LongTermMemory, scope: TenantScope, facts: dict[str, str]
) -> None:
    target = next(i for i, text in facts.items() if text == FACTS[1])
    vector = (await HashEmbedder().embed_query(FACTS[1])).astype(np.float32)

    hits = await ltm.search(scope, query(None, mode=SearchMode.VECTOR, vector=vector * 7.0, top_k=1))

    assert [(hit.item.id, round(hit.score, 5)) for hit in hits] == [(target, 1.0)], (
        "query vectors are normalised"
    )
    with pytest.raises(InvalidArgument) as raised:
        await ltm.search(scope, query(None, mode=SearchMode.VECTOR, vector=np.ones(12, dtype=np.float32)))
    assert raised.value.field == "query_vector"


async def test_a_new_agent_has_nothing_to_search(ltm: LongTermMemory) -> None:
    assert await ltm.search(scope_for(agent="newcomer"), query("anything")) == []


# --- update, forget, expiry -------------------------------------------------------------------


async def test_update_re_embeds_new_content_and_merges_replaces_or_removes_metadata(
    ltm: LongTermMemory, scope: TenantScope
) -> None:
    [(memory_id, _)] = await ltm.remember(scope, [item("the meeting is on monday", room="a", floor=1.0)])
    await ltm.remember(scope, [item("the office is in paris")])

    updated = await ltm.update(
        scope,
        memory_id,
        content=" the meeting is on tuesday ",
        metadata={"room": "b"},
        replace_metadata=False,
        remove_keys=["floor"],
        ttl_seconds=None,
    )
    assert (updated.content, updated.metadata) == ("the meeting is on tuesday", {"room": "b"})
    hits = await ltm.search(scope, query("the meeting is on tuesday", mode=SearchMode.VECTOR, top_k=1))
    assert [(hit.item.id, round(hit.score, 5)) for hit in hits] == [(memory_id, 1.0)]
    replaced = await ltm.update(
        scope,
        memory_id,
        content=None,
        metadata={"new": True},
        replace_metadata=True,
        remove_keys=[],
        ttl_seconds=None,
    )
    assert replaced.metadata == {"new": True}

    with pytest.raises(AlreadyExists) as raised:
        await ltm.update(
            scope,
            memory_id,
            content="the office is in paris",
            metadata=None,
            replace_metadata=False,
            remove_keys=[],
            ttl_seconds=None,
        )
    assert raised.value.field == "content"
    with pytest.raises(InvalidArgument) as too_many:
        await ltm.update(
            scope,
            memory_id,
            content=None,
            metadata={f"k{i}": i for i in range(40)},
            replace_metadata=False,
            remove_keys=[],
            ttl_seconds=None,
        )
    assert too_many.value.field == "metadata"
    with pytest.raises(NotFound):
        await ltm.update(
            scope,
            "00000000-0000-0000-0000-000000000000",
            content="x",
            metadata=None,
            replace_metadata=False,
            remove_keys=[],
            ttl_seconds=None,
        )
    assert (await ltm.get(scope, memory_id)).content == "the meeting is on tuesday"


async def test_a_memory_expires_after_its_ttl_and_the_sweeper_deletes_it(
    ltm: LongTermMemory, scope: TenantScope, clock: MovableClock
) -> None:
    [(short, _), (lasting, _)] = await ltm.remember(scope, [item("short lived", ttl=60), item("lasting")])
    assert (await ltm.get(scope, short)).expires_at == (await ltm.get(scope, short)).created_at + timedelta(
        seconds=60
    )

    clock.advance(59)
    assert (await ltm.get(scope, short)).content == "short lived"
    clock.advance(2)
    with pytest.raises(NotFound):
        await ltm.get(scope, short)
    assert [
        hit.item.id for hit in await ltm.search(scope, query("short lived lasting", mode=SearchMode.TEXT))
    ] == [lasting]
    assert await ltm.sweep_expired() == 1
    assert await ltm.sweep_expired() == 0
    # The expired content can be remembered again, as a new memory.
    [(again, dedup)] = await ltm.remember(scope, [item("short lived")])
    assert (again != short, dedup) == (True, False)


async def test_forget_and_forget_all_count_what_they_delete(ltm: LongTermMemory, scope: TenantScope) -> None:
    ids = [memory_id for memory_id, _ in await ltm.remember(scope, [item(f"fact {i}") for i in range(4)])]

    assert await ltm.forget(scope, [ids[0], ids[0], "00000000-0000-0000-0000-000000000000"]) == 1
    assert await ltm.forget_all(scope) == 3
    assert await ltm.forget_all(scope) == 0
    assert await ltm.forget(scope_for(agent="stranger"), ids) == 0


async def test_list_pages_newest_first_and_hands_back_a_cursor_when_more_remain(
    ltm: LongTermMemory, scope: TenantScope
) -> None:
    ids = [
        memory_id
        for memory_id, _ in await ltm.remember(scope, [item(f"note {i}", even=i % 2 == 0) for i in range(5)])
    ]

    seen: list[str] = []
    cursor = None
    while True:
        page, last = await ltm.list_page(scope, page_size=2, cursor=cursor, filter_=None)
        seen += [record.id for record in page]
        if last is None:
            break
        assert last == page[-1]
        cursor = PageCursor(last.created_at, last.id)

    assert seen == ids[::-1]
    evens, last = await ltm.list_page(
        scope, page_size=5, cursor=None, filter_=Condition("even", Operator.EQ, True)
    )
    assert ([record.id for record in evens], last) == ([ids[4], ids[2], ids[0]], None)


async def test_one_agents_memories_are_invisible_to_another_agent_and_user(
    ltm: LongTermMemory, scope: TenantScope
) -> None:
    [(memory_id, _)] = await ltm.remember(scope, [item("private to this user")])

    for stranger in (
        scope_for(agent="other-agent"),
        scope_for(agent=scope.agent),
        dataclasses.replace(scope, bucket_id=bucket()),
    ):
        with pytest.raises(NotFound):
            await ltm.get(stranger, memory_id)
        assert await ltm.search(stranger, query("private to this user")) == []


# --- conflicts the database resolves by rolling a transaction back --------------------------


class ConflictingStore(InProcessMemoryStore):
    """The in-process store, whose next `conflicts` inserts are rolled back (a deadlock on Citus)."""

    def __init__(self, conflicts: int) -> None:
        super().__init__()
        self.conflicts = conflicts
        self.inserts = 0

    async def insert(self, tenant: Tenant, bucket: str, rows: Sequence[NewMemory]) -> list[StoredRef]:
        self.inserts += 1
        if self.conflicts > 0:
            self.conflicts -= 1
            raise ConcurrentChange()
        return await super().insert(tenant, bucket, rows)


async def test_a_write_rolled_back_for_a_conflict_is_done_again(
    hashing: EmbedderRegistry, scope: TenantScope
) -> None:
    store = ConflictingStore(conflicts=2)
    ltm = LongTermMemory(store, hashing, default_embedder="hash")
    await ltm.remember(scope, [item("written on the third try")])
    assert store.inserts == 3
    listed, _ = await ltm.list_page(scope, page_size=10, cursor=None, filter_=None)
    assert [m.content for m in listed] == ["written on the third try"]


async def test_a_write_that_keeps_conflicting_answers_unavailable_and_writes_nothing(
    hashing: EmbedderRegistry, scope: TenantScope
) -> None:
    store = ConflictingStore(conflicts=3)
    ltm = LongTermMemory(store, hashing, default_embedder="hash")
    with pytest.raises(ConcurrentChange) as caught:
        await ltm.remember(scope, [item("never written")])
    assert caught.value.reason == Reason.DATABASE_UNAVAILABLE
    assert "retry" in str(caught.value)
    assert store.inserts == 3
    assert await ltm.list_page(scope, page_size=10, cursor=None, filter_=None) == ([], None)


async def test_a_search_runs_through_the_retrieval_engine_with_the_spaces_pins(
    ltm: LongTermMemory, scope: TenantScope, engine: RecordingEngine
) -> None:
    await ltm.remember(scope, [item("the cellar key is under the mat")])

    hits = await ltm.search(scope, query("cellar key", top_k=3, filter_=Condition("a", Operator.EQ, 1)))
    unfiltered = await ltm.search(scope, query("cellar key", top_k=3))

    assert [r for _, r in engine.searches] == [hits, unfiltered]
    assert [h.item.content for h in unfiltered] == ["the cellar key is under the mat"]
    (asked, _), (plain, _) = engine.searches
    assert (asked.text, asked.text_config, asked.dimension, asked.top_k) == ("cellar key", "english", 384, 3)
    # The query is embedded by the engine, with the space's pinned embedder.
    assert asked.vector is None
    assert asked.embedding is not None
    assert (asked.embedding.text, asked.embedding.embedder.spec.name) == ("cellar key", "hash")
    assert (asked.filtered, plain.filtered) == (True, False)
