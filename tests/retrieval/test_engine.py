"""The retrieval engine: the one path from a query to its results, for memories and knowledge bases.

Run on the in-process stores (no database): the store calls the engine's plan once, with the
searched rows' count, inside its search; the engine routes by that count and fuses what comes back.
That memory and knowledge search both go through it is checked with their services' unit tests
(tests/memory, tests/knowledge), on a `RecordingEngine`.
"""

from __future__ import annotations

from typing import Any

from tests.storage.conformance.support import (
    SPACE,
    axis,
    memory,
    new_bucket,
    new_tenant,
    unit,
)
from tokensvc.retrieval import (
    FusionWeights,
    Retrieval,
    RetrievalEngine,
    RoutedPlan,
    SearchMode,
    SearchTuning,
)
from tokensvc.storage.inprocess import InProcessMemoryStore
from tokensvc.storage.records import CandidateQuery, MemoryRecord, SearchOutcome

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
