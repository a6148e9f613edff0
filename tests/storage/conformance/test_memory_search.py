"""MemoryStore.search: the candidates of each ranker with both scores, ranks and tie-breaks, the
bucket count up to the cap, BM25 values, and neighbours (the bucket's adjacent memories)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from tests.storage.conformance.support import (
    EMBEDDER,
    EXACTNESS,
    SPACE,
    axis,
    by_item,
    cosine,
    counted_rows,
    memory,
    random_unit,
    ranks,
    reference_bm25,
    reference_ideal,
    search,
    text_query,
    unit,
    vector_query,
)
from tests.storage.search_support import EmbeddedLater, search_candidates
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.ports import MemoryStore
from tokensvc.storage.records import CandidateQuery, NewMemory, Tenant


async def store_rows(store: MemoryStore, tenant: Tenant, bucket: str, rows: list[NewMemory]) -> None:
    """Pin the `simple` space (rows are indexed with it), then insert in order."""
    await store.pin_space(tenant, SPACE)
    await store.insert(tenant, bucket, rows)


# --- the vector ranker ------------------------------------------------------------------------


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_vector_candidates_are_the_true_top_k_by_inner_product(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator, exact: bool
) -> None:
    rows = [memory(f"memory {i}", random_unit(rng)) for i in range(40)]
    await store_rows(memories, tenant, bucket, rows)
    query = random_unit(rng)
    scores = {row.id: cosine(row.embedding, query) for row in rows}

    found = await search(memories, tenant, bucket, vector_query(query, k=5, exact=exact))

    assert [c.item.id for c in found] == sorted(scores, key=lambda i: -scores[i])[:5]
    assert [c.vector_rank for c in found] == [1, 2, 3, 4, 5]
    for c in found:
        assert c.vector_score == pytest.approx(scores[c.item.id], abs=1e-5)
        assert (c.text_score, c.text_rank, c.previous, c.next, c.previous_key, c.next_key) == (
            0.0,
            0,
            None,
            None,
            None,
            None,
        )
        assert c.item.embedder == EMBEDDER


async def test_fewer_rows_than_k_return_every_row(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(f"memory {i}", random_unit(rng)) for i in range(3)]
    await store_rows(memories, tenant, bucket, rows)

    for exact in EXACTNESS:
        found = await search(memories, tenant, bucket, vector_query(random_unit(rng), k=10, exact=exact))
        assert sorted(c.item.id for c in found) == sorted(row.id for row in rows)


def tie_queries(query: np.ndarray) -> list[CandidateQuery]:
    """The statement shapes a vector ranker runs in: plain, with neighbours, and hybrid."""
    return [
        vector_query(query, k=3),
        vector_query(query, k=3, neighbours=True),
        text_query("unrelated", k=3, row_count=10, vector=query),
        text_query("unrelated", k=3, row_count=10, vector=query, neighbours=True),
    ]


async def test_vector_ties_break_by_id(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    query = axis(0)
    tied = [memory(f"tied memory {i}", axis(0)) for i in range(6)]
    lower = [memory("a little off", unit([0.9, 0.1, 0, 0, 0, 0, 0, 0]))]
    await store_rows(memories, tenant, bucket, [*lower, *tied])
    best = sorted(row.id for row in tied)[:3]

    for query_shape in tie_queries(query):
        found = await search(memories, tenant, bucket, query_shape)
        ranked = sorted((c for c in found if c.vector_rank), key=lambda c: c.vector_rank)
        assert [(c.item.id, c.vector_rank) for c in ranked] == [(i, r) for r, i in enumerate(best, 1)], (
            query_shape
        )


# --- counting ---------------------------------------------------------------------------------


async def test_search_counts_the_bucket_up_to_the_cap_when_the_count_is_unknown(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    assert await counted_rows(memories, tenant, bucket, 10) == 0
    await memories.insert(
        tenant, bucket, [memory(f"m{i}", random_unit(rng), metadata={"even": i % 2 == 0}) for i in range(5)]
    )

    assert await counted_rows(memories, tenant, bucket, 3) == 3
    assert await counted_rows(memories, tenant, bucket, 5) == 5
    assert await counted_rows(memories, tenant, bucket, 1000) == 5
    assert await counted_rows(memories, tenant, bucket, 1000, Condition("even", Operator.EQ, True)) == 5, (
        "the count is the bucket's, not the filter's"
    )


async def test_the_count_includes_expired_rows_not_swept_yet(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    await memories.insert(
        tenant, bucket, [memory("live", random_unit(rng)), memory("dead", random_unit(rng), ttl=0)]
    )

    assert await counted_rows(memories, tenant, bucket, 1000) == 2
    await memories.delete_all(tenant, bucket)
    assert await counted_rows(memories, tenant, bucket, 1000) == 0


async def test_a_known_row_count_reaches_the_plan_unchanged(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    await memories.insert(tenant, bucket, [memory("one row", random_unit(rng))])
    seen: list[int] = []

    def plan(rows: int) -> CandidateQuery:
        seen.append(rows)
        return vector_query(axis(1), k=1, row_count=rows)

    outcome = await memories.search(
        tenant, bucket, plan, row_count=777, count_cap=10, filter_=None, embedder=EMBEDDER
    )

    assert (seen, outcome.row_count, len(outcome.candidates)) == ([777], 777, 1)


# --- the text ranker --------------------------------------------------------------------------

TEXTS = [
    "red apple pie",
    "green apple",
    "red red wine",
    "blue sky over the sea",
    "apple apple apple tart with cream",
    "pie crust recipe",
    "nothing in common here",
]


@pytest.mark.parametrize("row_count", [1, 7, 500])
async def test_text_candidates_score_bm25_over_the_rows_matching_any_query_word(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator, row_count: int
) -> None:
    rows = [memory(text, random_unit(rng)) for text in TEXTS]
    await store_rows(memories, tenant, bucket, rows)
    texts = {row.id: row.content for row in rows}
    expected = reference_bm25(texts, "Red apple?", row_count=row_count)
    assert len(expected) == 4

    for exact in EXACTNESS:
        found = by_item(
            await search(
                memories, tenant, bucket, text_query("Red apple?", k=3, row_count=row_count, exact=exact)
            ),
            lambda item: item.id,
        )

        assert set(found) == set(ranks(expected, 3)), "the top 3 by BM25"
        ideal = reference_ideal(texts, "Red apple?", row_count=row_count)
        for memory_id, c in found.items():
            assert c.text_score == pytest.approx(expected[memory_id], rel=1e-9)
            assert c.text_ideal == pytest.approx(ideal, rel=1e-9)
            assert c.text_score < c.text_ideal
            assert c.text_rank == ranks(expected, 3)[memory_id]
            assert (c.vector_score, c.vector_rank, c.previous, c.next) == (0.0, 0, None, None)


async def test_text_ties_break_by_id(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    # The same words in another order: the same BM25 score, and other content.
    rows = [memory(text, random_unit(rng)) for text in ("alpha beta", "beta alpha", "alpha beta gamma delta")]
    await store_rows(memories, tenant, bucket, rows)
    first = min(rows[0].id, rows[1].id)

    found = await search(memories, tenant, bucket, text_query("alpha", k=1, row_count=3))

    assert [(c.item.id, c.text_rank) for c in found] == [(first, 1)]
    both = await search(memories, tenant, bucket, text_query("alpha", k=3, row_count=3))
    tied = sorted((c for c in both if c.item.id in {rows[0].id, rows[1].id}), key=lambda c: c.text_rank)
    assert [c.item.id for c in tied] == sorted([rows[0].id, rows[1].id])
    assert tied[0].text_score == tied[1].text_score
    assert {c.text_rank for c in both} == {1, 2, 3}


async def test_a_query_without_words_or_without_matches_has_no_text_candidates(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(text, random_unit(rng)) for text in TEXTS]
    await store_rows(memories, tenant, bucket, rows)

    assert await search(memories, tenant, bucket, text_query("?! ...", k=5, row_count=7)) == []
    assert await search(memories, tenant, bucket, text_query("zebra unicorn", k=5, row_count=7)) == []
    hybrid = await search(
        memories, tenant, bucket, text_query("?!", k=2, row_count=7, vector=rows[0].embedding)
    )
    best = next(c for c in hybrid if c.vector_rank == 1)
    assert (best.item.id, best.text_score, best.text_rank) == (rows[0].id, 0.0, 0)
    assert sorted(c.vector_rank for c in hybrid) == [1, 2]
    assert all(c.text_rank == 0 for c in hybrid)


# --- hybrid -----------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_hybrid_candidates_are_both_rankers_top_k_each_with_both_scores(
    memories: MemoryStore, tenant: Tenant, bucket: str, exact: bool
) -> None:
    # Vectors along distinct axes, so cosines are known; texts chosen for BM25.
    vectors = [unit([1, 0.1 * i, 0, 0, 0, 0, 0, 0]) for i in range(len(TEXTS))]
    vectors[4] = axis(3)  # the best text match points away from the query vector
    rows = [memory(text, vector) for text, vector in zip(TEXTS, vectors, strict=True)]
    await store_rows(memories, tenant, bucket, rows)
    query_vector = axis(0)
    texts = {row.id: row.content for row in rows}
    bm25 = reference_bm25(texts, "apple pie", row_count=20)
    cosines = {row.id: cosine(row.embedding, query_vector) for row in rows}
    k = 2

    found = by_item(
        await search(
            memories,
            tenant,
            bucket,
            text_query("apple pie", k=k, row_count=20, vector=query_vector, exact=exact),
        ),
        lambda item: item.id,
    )

    vector_ranks, text_ranks = ranks(cosines, k), ranks(bm25, k)
    assert set(found) == set(vector_ranks) | set(text_ranks)
    assert len(found) > k, "the fixture makes the rankers disagree"
    for memory_id, c in found.items():
        assert c.vector_score == pytest.approx(cosines[memory_id], abs=1e-5)
        assert c.text_score == pytest.approx(bm25.get(memory_id, 0.0), rel=1e-9)
        assert (c.vector_rank, c.text_rank) == (vector_ranks.get(memory_id, 0), text_ranks.get(memory_id, 0))
        assert (c.previous, c.next) == (None, None), "neighbours only when asked"


# --- neighbours -------------------------------------------------------------------------------


NEIGHBOUR_SHAPES = {
    "vector": lambda q, exact: vector_query(q, k=10, exact=exact, neighbours=True),
    "text": lambda q, exact: text_query("apple pie wine", k=10, row_count=10, exact=exact, neighbours=True),
    "hybrid": lambda q, exact: text_query(
        "apple pie wine", k=10, row_count=10, vector=q, exact=exact, neighbours=True
    ),
}


@pytest.mark.parametrize("shape", NEIGHBOUR_SHAPES)
@pytest.mark.parametrize("exact", EXACTNESS)
async def test_neighbours_are_the_searchable_memories_one_and_two_places_away_with_both_their_scores(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator, shape: str, exact: bool
) -> None:
    # Remembered in this order; `hidden` rows are filtered out, the expired one is dead: neither
    # is anyone's neighbour, so the searchable rows' neighbours skip them.
    plan = [
        ("red apple pie", False, None),
        ("a hidden memory about pie", True, None),
        ("green apple", False, None),
        ("an expired pie memory", False, 0),
        ("red red wine", False, None),
        ("blue sky over the sea", False, None),
        ("pie crust recipe", False, None),
    ]
    rows = [
        memory(text, random_unit(rng), metadata={"hidden": hidden}, ttl=ttl) for text, hidden, ttl in plan
    ]
    await store_rows(memories, tenant, bucket, rows[:3])
    await memories.insert(tenant, bucket, rows[3:])
    searchable = [row for row, (_, hidden, ttl) in zip(rows, plan, strict=True) if not hidden and ttl is None]
    query_vector = random_unit(rng)
    query = NEIGHBOUR_SHAPES[shape](query_vector, exact)
    bm25 = reference_bm25({row.id: row.content for row in searchable}, "apple pie wine", row_count=10)

    def scores(row: NewMemory) -> tuple[float, float]:
        vector = 0.0 if query.vector is None else cosine(row.embedding, query_vector)
        return vector, (bm25.get(row.id, 0.0) if query.text is not None else 0.0)

    found = by_item(
        await search(memories, tenant, bucket, query, Condition("hidden", Operator.EQ, False)),
        lambda item: item.id,
    )

    assert found, "the fixture has candidates in every shape"
    position = {row.id: i for i, row in enumerate(searchable)}

    def at(i: int) -> NewMemory | None:
        return searchable[i] if 0 <= i < len(searchable) else None

    for memory_id, c in found.items():
        i = position[memory_id]
        neighbours = [
            (c.previous, c.previous_key, at(i - 1)),
            (c.next, c.next_key, at(i + 1)),
            (c.second_previous, c.second_previous_key, at(i - 2)),
            (c.second_next, c.second_next_key, at(i + 2)),
        ]
        for got, key, row in neighbours:
            assert key == (None if row is None else row.id)
            if row is None:
                assert got is None
            else:
                assert got is not None
                assert got == pytest.approx(scores(row), abs=1e-5)


# --- ranking by text while the query embeds ---------------------------------------------------


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_a_memory_written_while_the_query_embeds_is_not_seen_one_snapshot(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator, exact: bool
) -> None:
    rows = [memory(f"apple note {i}", random_unit(rng)) for i in range(12)]
    await store_rows(memories, tenant, bucket, rows)
    vector = random_unit(rng)
    later = EmbeddedLater()
    query = dataclasses.replace(
        text_query("apple", k=5, row_count=12, exact=exact, neighbours=True), vector_later=later
    )
    searching = asyncio.ensure_future(
        search_candidates(memories, tenant, bucket, query, filter_=None, embedder=EMBEDDER)
    )

    await asyncio.wait_for(later.awaited.wait(), 30)
    # Best for both rankers, written (and committed) while the search waits for its vector.
    newcomer = memory("apple apple apple", vector)
    await memories.insert(tenant, bucket, [newcomer])
    later.vector.set_result(vector)
    found = await searching

    assert {c.item.id for c in found} <= {row.id for row in rows}, "the search read before the write"
    assert len([c for c in found if c.vector_rank]) == 5
    again = await search(
        memories, tenant, bucket, text_query("apple", k=5, row_count=13, vector=vector, exact=exact)
    )
    assert newcomer.id in {c.item.id for c in again}, "a search after the write sees it"


async def test_a_query_word_no_memory_holds_lowers_every_text_score_against_its_ideal(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(text, random_unit(rng)) for text in TEXTS]
    await store_rows(memories, tenant, bucket, rows)
    texts = {row.id: row.content for row in rows}

    plain = await search(memories, tenant, bucket, text_query("apple", k=3, row_count=7))
    padded = await search(memories, tenant, bucket, text_query("apple kiwi", k=3, row_count=7))

    assert [c.text_ideal for c in padded] == pytest.approx(
        [reference_ideal(texts, "apple kiwi", row_count=7)] * 3
    )
    assert [c.text_score for c in padded] == [c.text_score for c in plain], "kiwi matches nothing"
    assert all(
        p.text_score / p.text_ideal < c.text_score / c.text_ideal for p, c in zip(padded, plain, strict=True)
    )
