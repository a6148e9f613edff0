"""The retrieval engine: the one path from a query to its results, for memories and knowledge bases.

Run on the in-process stores (no database): the store calls the engine's plan once, with the
searched rows' count, inside its search; the engine routes by that count and fuses what comes back.
That memory and knowledge search both go through it is checked with their services' unit tests
(tests/memory, tests/knowledge), on a `RecordingEngine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from tests.storage.conformance.support import (
    SPACE,
    axis,
    memory,
    new_bucket,
    new_tenant,
    unit,
)
from tokensvc.embedders import HashEmbedder, ScheduledEmbedder, WorkClass
from tokensvc.errors import DatabaseUnavailable, EmbedderUnavailable
from tokensvc.retrieval import (
    FusionWeights,
    QueryEmbedding,
    Retrieval,
    RetrievalEngine,
    RoutedPlan,
    SearchMode,
    SearchTuning,
    unit_vector,
)
from tokensvc.storage.inprocess import InProcessMemoryStore
from tokensvc.storage.records import CandidateQuery, MemoryRecord, SearchOutcome, Tenant

DIM = SPACE.embedder.dimension


def retrieval(
    mode: SearchMode = SearchMode.HYBRID,
    *,
    text: str | None = "apple",
    top_k: int = 2,
    filtered: bool = False,
    dimension: int = DIM,
    min_score: float | None = None,
) -> Retrieval:
    vector = None if mode is SearchMode.TEXT else axis(0)
    return Retrieval(
        mode=mode,
        text=text,
        vector=vector,
        top_k=top_k,
        min_score=min_score,
        filtered=filtered,
        text_config="simple",
        dimension=dimension,
    )


async def test_the_store_calls_the_plan_once_with_the_bucket_count_and_the_engine_fuses_its_candidates() -> (
    None
):
    store = InProcessMemoryStore()
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    await store.insert(
        tenant,
        bucket,
        [
            memory(
                "apple pie with a lot of cream", axis(1)
            ),  # the text matches (a longer row), the vector not
            memory("pear tart", unit([1, 0.1, 0, 0, 0, 0, 0, 0])),  # the vector matches, the text not
            memory("apple crumble", unit([1, 1, 0, 0, 0, 0, 0, 0])),  # both: the best
            memory("plum jam", axis(2)),
        ],
    )
    engine = RetrievalEngine(SearchTuning(exact_threshold=3), FusionWeights(neighbour=0.0))
    counts: list[int] = []
    queries: list[CandidateQuery] = []

    async def fetch(plan: RoutedPlan) -> SearchOutcome[MemoryRecord]:
        def noted(rows: int) -> CandidateQuery:
            counts.append(rows)
            queries.append(plan(rows))
            return queries[-1]

        return await store.search(
            tenant, bucket, noted, count_cap=plan.count_cap, filter_=None, embedder=SPACE.embedder.name
        )

    hits = await engine.search(retrieval(), fetch)

    assert counts == [4], "the store counted the bucket and called the plan once"
    assert queries[0].exact is False  # 4 rows: above the threshold of 3, so HNSW
    assert queries[0].row_count == 4  # BM25's N
    assert [hit.item.content for hit in hits] == ["apple crumble", "pear tart"]
    assert hits[0].vector_rank == 2
    assert hits[0].text_rank == 1


def test_a_plan_routes_by_row_count_filter_and_dimension() -> None:
    engine = RetrievalEngine(SearchTuning(exact_threshold=10, filtered_exact_factor=4))
    plain = engine.plan(retrieval())
    filtered = engine.plan(retrieval(filtered=True))
    wide = engine.plan(retrieval(dimension=3000))  # more than HNSW indexes

    assert plain.count_cap == 41  # enough to route a filtered search too
    assert [plain(10).exact, plain(11).exact] == [True, False]
    assert [filtered(40).exact, filtered(41).exact] == [True, False]
    assert wide(1_000_000).exact is True


def test_vector_mode_asks_for_top_k_alone_and_hybrid_for_candidates_with_neighbours() -> None:
    engine = RetrievalEngine(SearchTuning(candidates=50), FusionWeights(neighbour=0.7))

    vector = engine.plan(retrieval(SearchMode.VECTOR, top_k=5))(3)
    hybrid = engine.plan(retrieval(SearchMode.HYBRID, top_k=5))(3)
    text = engine.plan(retrieval(SearchMode.TEXT, top_k=5))(3)
    unneighboured = RetrievalEngine(fusion=FusionWeights(neighbour=0.0)).plan(retrieval())(3)

    assert (vector.k, vector.text, vector.neighbours) == (5, None, False)
    assert (hybrid.k, hybrid.text, hybrid.or_text, hybrid.neighbours) == (50, "apple", "apple", True)
    assert (text.k, text.vector, text.neighbours) == (50, None, False)
    assert unneighboured.neighbours is False


async def test_min_score_and_top_k_cut_the_fused_results() -> None:
    store = InProcessMemoryStore()
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    await store.insert(
        tenant, bucket, [memory(f"fact {i}", unit([1, i, 0, 0, 0, 0, 0, 0])) for i in range(5)]
    )
    engine = RetrievalEngine()

    def fetch(plan: RoutedPlan) -> Any:
        return store.search(tenant, bucket, plan, count_cap=plan.count_cap, filter_=None, embedder="test")

    everything = await engine.search(retrieval(SearchMode.VECTOR, top_k=10), fetch)
    cut = await engine.search(retrieval(SearchMode.VECTOR, top_k=10, min_score=everything[2].score), fetch)
    top = await engine.search(retrieval(SearchMode.VECTOR, top_k=2), fetch)

    assert [h.item.content for h in everything] == [f"fact {i}" for i in range(5)]
    assert [h.item.content for h in cut] == ["fact 0", "fact 1", "fact 2"]
    assert [h.item.content for h in top] == ["fact 0", "fact 1"]


# --- ranking by text while the query embeds -----------------------------------------------------


class GatedEmbedder(HashEmbedder):
    """The hashing embedder whose queries finish only when the test opens the gate."""

    def __init__(self) -> None:
        super().__init__("gated", DIM)
        self.gate = asyncio.Event()

    async def embed_query(self, text: str) -> np.ndarray:
        await self.gate.wait()
        return await super().embed_query(text)


async def fruit_store() -> tuple[InProcessMemoryStore, Tenant, str]:
    store = InProcessMemoryStore()
    bucket = new_bucket()
    tenant = new_tenant(bucket)
    await store.pin_space(tenant, SPACE)
    texts = ["apple pie", "apple crumble with cream", "pear tart", "plum jam", "apple and pear salad"]
    await store.insert(
        tenant, bucket, [memory(text, unit(np.arange(DIM) + i)) for i, text in enumerate(texts)]
    )
    return store, tenant, bucket


def embedded(embedder: ScheduledEmbedder, mode: SearchMode = SearchMode.HYBRID) -> Retrieval:
    return dataclasses.replace(
        retrieval(mode, top_k=3), vector=None, embedding=QueryEmbedding(embedder, "apple", "ns", "agent")
    )


async def test_a_hybrid_search_by_text_ranks_by_text_while_its_query_embeds() -> None:
    store, tenant, bucket = await fruit_store()
    gated = GatedEmbedder()
    embedder = ScheduledEmbedder(gated, tenant_queue_texts=8)
    engine = RetrievalEngine()
    pending_when_planned: list[bool] = []

    async def fetch(plan: RoutedPlan) -> SearchOutcome[MemoryRecord]:
        def noted(rows: int) -> CandidateQuery:
            query = plan(rows)
            assert query.vector is None
            assert isinstance(query.vector_later, asyncio.Future)
            pending_when_planned.append(not query.vector_later.done())
            gated.gate.set()  # the store has its plan (and its snapshot): the embedding may finish
            return query

        return await store.search(
            tenant, bucket, noted, count_cap=plan.count_cap, filter_=None, embedder="test"
        )

    hits = await engine.search(embedded(embedder), fetch)
    vector = unit_vector(await embedder.embed_query("apple", "ns"), "query")
    given = await engine.search(
        dataclasses.replace(embedded(embedder), vector=vector, embedding=None),
        lambda plan: store.search(
            tenant, bucket, plan, count_cap=plan.count_cap, filter_=None, embedder="test"
        ),
    )

    assert pending_when_planned == [True], "the store planned before the query's vector existed"
    assert hits == given, "the same results as with the vector embedded first"


async def test_a_search_embeds_first_in_vector_mode_and_when_queries_wait_for_the_embedder() -> None:
    store, tenant, bucket = await fruit_store()
    gated = GatedEmbedder()
    embedder = ScheduledEmbedder(gated, tenant_queue_texts=8)
    engine = RetrievalEngine()
    planned: list[CandidateQuery] = []

    def fetch(plan: RoutedPlan) -> Any:
        def noted(rows: int) -> CandidateQuery:
            planned.append(plan(rows))
            return planned[-1]

        return store.search(tenant, bucket, noted, count_cap=plan.count_cap, filter_=None, embedder="test")

    # Other queries: they hold every slot of the embedder, and one more waits.
    busy = embedder.capacity.slots + embedder.capacity.fast_slots + 1
    others = [asyncio.ensure_future(embedder.embed_query(f"other {i}", "ns")) for i in range(busy)]
    await asyncio.sleep(0)
    assert embedder.scheduler.queued_texts(WorkClass.QUERY) == 1
    queued = asyncio.ensure_future(engine.search(embedded(embedder), fetch))
    await asyncio.sleep(0)
    assert planned == [], "nothing is planned (no connection held) while the query waits"
    gated.gate.set()
    await asyncio.gather(*others, queued)
    await engine.search(embedded(embedder, SearchMode.VECTOR), fetch)

    assert [(q.vector is not None, q.vector_later) for q in planned] == [(True, None), (True, None)]


async def test_a_failed_store_cancels_the_embedding_and_a_failed_embedding_fails_the_search() -> None:
    store, tenant, bucket = await fruit_store()
    gated = GatedEmbedder()
    engine = RetrievalEngine()
    seen: list[Any] = []

    async def failing(plan: RoutedPlan) -> SearchOutcome[MemoryRecord]:
        seen.append(plan.vector_later)
        raise DatabaseUnavailable()

    with pytest.raises(DatabaseUnavailable):
        await engine.search(embedded(ScheduledEmbedder(gated, tenant_queue_texts=8)), failing)
    assert isinstance(seen[0], asyncio.Future)
    await asyncio.wait([seen[0]])
    assert seen[0].cancelled(), "the embedding nobody waits for any more was cancelled"

    class Broken(HashEmbedder):
        async def embed_query(self, text: str) -> np.ndarray:
            raise EmbedderUnavailable("the model failed")

    broken = ScheduledEmbedder(Broken("broken", DIM), tenant_queue_texts=8)
    with pytest.raises(EmbedderUnavailable, match="the model failed"):
        await engine.search(
            embedded(broken),
            lambda plan: store.search(
                tenant, bucket, plan, count_cap=plan.count_cap, filter_=None, embedder="test"
            ),
        )
