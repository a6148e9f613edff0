"""KnowledgeStore.search: candidates over the chunks of the searched knowledge bases, ties by key,
BM25 over chunks, the chunk count up to the cap, neighbours within a document version, filters
on the document's metadata, and the roster."""

from __future__ import annotations

import numpy as np
import pytest

from tests.storage.conformance.support import (
    EXACTNESS,
    axis,
    by_item,
    citation,
    cosine,
    counted_chunks,
    create_base,
    launcher,
    management,
    new_namespace,
    random_unit,
    ranks,
    reference_bm25,
    search_chunks,
    text_query,
    unit,
    upload,
    vector_query,
)
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.ports import KnowledgeStore, StaleKnowledgeBases
from tokensvc.storage.records import CandidateQuery, KnowledgePins

DOCS = {
    "kb-a": {
        "pies": ["red apple pie", "pie crust recipe", "baking the pie"],
        "drinks": ["red red wine", "green tea"],
    },
    "kb-b": {"fruit": ["green apple", "apple apple apple tart with cream", "a ripe pear"]},
}


async def corpus(
    store: KnowledgeStore, rng: np.random.Generator
) -> tuple[str, dict[tuple[str, str, int], np.ndarray]]:
    """Two knowledge bases of the namespace; each chunk's vector by (kb, doc, index)."""
    ns = new_namespace()
    vectors: dict[tuple[str, str, int], np.ndarray] = {}
    for kb, documents in DOCS.items():
        await create_base(store, ns, kb)
        for doc, texts in documents.items():
            chunk_vectors = [random_unit(rng) for _ in texts]
            await upload(store, ns, kb, doc, texts, vectors=chunk_vectors, metadata={"kind": doc})
            vectors |= {(kb, doc, i): v for i, v in enumerate(chunk_vectors)}
    return ns, vectors


def text_of(kb: str, doc: str, index: int) -> str:
    return DOCS[kb][doc][index]


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_vector_candidates_are_the_true_top_k_over_every_searched_base(
    knowledge: KnowledgeStore, rng: np.random.Generator, exact: bool
) -> None:
    ns, vectors = await corpus(knowledge, rng)
    query = random_unit(rng)
    scores = {key: cosine(vector, query) for key, vector in vectors.items()}

    found = await search_chunks(
        knowledge, launcher(ns, "kb-a", "kb-b"), ["kb-a", "kb-b"], vector_query(query, k=4, exact=exact)
    )

    best = sorted(scores, key=lambda key: -scores[key])[:4]
    assert [(c.item.kb_ref, c.item.doc_ref, c.item.chunk_index) for c in found] == best
    assert [c.vector_rank for c in found] == [1, 2, 3, 4]
    for c in found:
        assert c.vector_score == pytest.approx(
            scores[(c.item.kb_ref, c.item.doc_ref, c.item.chunk_index)], abs=1e-5
        )
        assert c.item.text == text_of(c.item.kb_ref, c.item.doc_ref, c.item.chunk_index)
        assert c.item.version == 1


async def test_vector_ties_break_by_base_document_version_and_chunk(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    for kb in ("kb-y", "kb-x"):
        await create_base(knowledge, ns, kb)
        for doc in ("doc-b", "doc-a"):
            await upload(knowledge, ns, kb, doc, [f"{kb} {doc} {i}" for i in range(3)], vectors=[axis(0)] * 3)
    await upload(
        knowledge, ns, "kb-x", "doc-b", ["changed 0", "changed 1"], vectors=[axis(0)] * 2
    )  # version 2
    refs = ["kb-x", "kb-y"]
    expected = [
        ("kb-x", "doc-a", 1, 0),
        ("kb-x", "doc-a", 1, 1),
        ("kb-x", "doc-a", 1, 2),
        ("kb-x", "doc-b", 2, 0),
    ]

    for query in (
        vector_query(axis(0), k=4),
        vector_query(axis(0), k=4, neighbours=True),
        text_query("nothing", k=4, row_count=10, vector=axis(0)),
        text_query("nothing", k=4, row_count=10, vector=axis(0), neighbours=True),
    ):
        found = await search_chunks(knowledge, management(ns), refs, query)
        ranked = sorted((c for c in found if c.vector_rank), key=lambda c: c.vector_rank)
        assert [citation(c.item) for c in ranked] == expected, query


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_text_candidates_score_bm25_over_the_chunks(
    knowledge: KnowledgeStore, rng: np.random.Generator, exact: bool
) -> None:
    ns, vectors = await corpus(knowledge, rng)
    texts = {key: text_of(*key) for key in vectors}
    expected = reference_bm25(texts, "red apple pie", row_count=30)
    k = 3

    found = by_item(
        await search_chunks(
            knowledge,
            management(ns),
            ["kb-a", "kb-b"],
            text_query("red apple pie", k=k, row_count=30, exact=exact),
        ),
        lambda item: (item.kb_ref, item.doc_ref, item.chunk_index),
    )

    assert set(found) == set(ranks(expected, k))
    for key, c in found.items():
        assert c.text_score == pytest.approx(expected[key], rel=1e-9)
        assert c.text_rank == ranks(expected, k)[key]
        assert (c.vector_score, c.vector_rank) == (0.0, 0)


async def test_search_counts_the_chunks_of_the_searched_bases_up_to_the_cap(
    knowledge: KnowledgeStore, rng: np.random.Generator
) -> None:
    ns, _ = await corpus(knowledge, rng)

    assert await counted_chunks(knowledge, management(ns), ["kb-a", "kb-b"], 1000) == 8
    assert await counted_chunks(knowledge, management(ns), ["kb-a"], 1000) == 5
    assert await counted_chunks(knowledge, management(ns), ["kb-a", "kb-b"], 6) == 6
    assert await counted_chunks(knowledge, launcher(ns, "kb-b"), ["kb-a", "kb-b"], 1000) == 3, (
        "the roster limits"
    )
    assert await counted_chunks(knowledge, management(ns), ["missing"], 1000) == 0


@pytest.mark.parametrize("exact", EXACTNESS)
async def test_neighbours_are_the_chunks_one_and_two_places_away_in_the_same_document_version(
    knowledge: KnowledgeStore, rng: np.random.Generator, exact: bool
) -> None:
    ns, vectors = await corpus(knowledge, rng)
    query_vector = random_unit(rng)
    texts = {key: text_of(*key) for key in vectors}
    bm25 = reference_bm25(texts, "apple pie wine", row_count=8)

    found = await search_chunks(
        knowledge,
        management(ns),
        ["kb-a", "kb-b"],
        text_query("apple pie wine", k=8, row_count=8, vector=query_vector, exact=exact, neighbours=True),
    )

    assert len(found) == 8
    for c in found:
        kb, doc, i = c.item.kb_ref, c.item.doc_ref, c.item.chunk_index
        size = len(DOCS[kb][doc])
        neighbours = [
            (c.previous, c.previous_key, i - 1),
            (c.next, c.next_key, i + 1),
            (c.second_previous, c.second_previous_key, i - 2),
            (c.second_next, c.second_next_key, i + 2),
        ]
        for got, key, j in neighbours:
            assert key == (j if 0 <= j < size else None)
            if not 0 <= j < size:
                assert got is None
            else:
                assert got == pytest.approx(
                    (cosine(vectors[(kb, doc, j)], query_vector), bm25.get((kb, doc, j), 0.0)), abs=1e-5
                )


async def test_filters_apply_to_the_documents_metadata(
    knowledge: KnowledgeStore, rng: np.random.Generator
) -> None:
    ns, _ = await corpus(knowledge, rng)

    found = await search_chunks(
        knowledge,
        management(ns),
        ["kb-a", "kb-b"],
        text_query("red apple pie", k=10, row_count=8, vector=axis(0), neighbours=True),
        Condition("kind", Operator.IN, values=("pies", "fruit")),
    )

    assert {c.item.doc_ref for c in found} == {"pies", "fruit"}
    assert all(c.text_score == 0.0 or c.item.doc_ref != "drinks" for c in found)


async def test_knowledge_bases_outside_the_roster_or_namespace_are_never_searched(
    knowledge: KnowledgeStore, rng: np.random.Generator
) -> None:
    ns, _ = await corpus(knowledge, rng)
    vector = unit(np.ones(8))

    for tenant, refs, expected in (
        (launcher(ns, "kb-b"), ["kb-a", "kb-b"], {"kb-b"}),
        (launcher(ns, "kb-a"), ["kb-b"], set()),
        (launcher(new_namespace(), "kb-a", "kb-b"), ["kb-a", "kb-b"], set()),
    ):
        for query in (vector_query(vector, k=20), text_query("apple red", k=20, row_count=8, vector=vector)):
            found = await search_chunks(knowledge, tenant, refs, query)
            assert {c.item.kb_ref for c in found} == expected


async def test_a_search_with_pins_that_still_hold_searches(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    base = await create_base(knowledge, ns, "kb")
    await upload(knowledge, ns, "kb", "doc", ["pinned text"])
    pins = KnowledgePins(("kb", "absent"), (("kb", base.created_at, 0),))
    outcome = await knowledge.search(
        launcher(ns, "kb", "absent"),
        ["kb"],
        lambda _rows: vector_query(axis(0), k=5),
        row_count=1,
        count_cap=1,
        filter_=None,
        generations=[0],
        expect=pins,
    )
    assert [c.item.text for c in outcome.candidates] == ["pinned text"]


async def test_a_search_whose_pins_changed_refuses_and_searches_nothing(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    old = await create_base(knowledge, ns, "kb")
    tenant = launcher(ns, "kb", "later")
    remembered = KnowledgePins(("kb", "later"), (("kb", old.created_at, 0),))
    searched: list[int] = []

    async def search(pins: KnowledgePins) -> None:
        def plan(rows: int) -> CandidateQuery:
            searched.append(rows)
            return vector_query(axis(0), k=5)

        await knowledge.search(
            tenant, ["kb"], plan, row_count=None, count_cap=10, filter_=None, generations=[0], expect=pins
        )

    # A base of the roster created since, the base re-created since, the base gone: each refuses.
    await create_base(knowledge, ns, "later")
    with pytest.raises(StaleKnowledgeBases):
        await search(remembered)
    later = (await knowledge.get_bases(management(ns), ["later"]))[0]
    assert await knowledge.delete_base(management(ns), "kb") == 0
    again = await create_base(knowledge, ns, "kb")
    with pytest.raises(StaleKnowledgeBases):
        await search(
            KnowledgePins(remembered.roster, (("kb", old.created_at, 0), ("later", later.created_at, 0)))
        )
    await knowledge.delete_base(management(ns), "kb")
    with pytest.raises(StaleKnowledgeBases):
        await search(
            KnowledgePins(remembered.roster, (("kb", again.created_at, 0), ("later", later.created_at, 0)))
        )
    assert searched == [], "a refused search counts and ranks nothing"
