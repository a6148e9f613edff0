"""Memory search ranking end to end on the real database: the text ranker's stemming, stop words,
OR semantics and rare-term weighting, the pinned text-search configuration, and HYBRID fusion.

These use the `hash` embedder (no meaning) so that what is asserted is the text ranker's doing;
tests/api/test_memory_real_model.py covers meaning with the embedded model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from tests.api.memory_support import Caller, Launchers
from tests.support import SharedDatabase, connect_as
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import common_pb2

TEXT = common_pb2.SEARCH_MODE_TEXT
HYBRID = common_pb2.SEARCH_MODE_HYBRID
VECTOR = common_pb2.SEARCH_MODE_VECTOR


async def contents(caller: Caller, query: str, **fields: Any) -> list[str]:
    return [r.memory.content for r in await caller.search(query, **fields)]


async def test_text_search_matches_any_term_of_a_question_stemmed(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember(
        "Alice prefers answers in French",
        "The deployments were rolled back on Tuesday",
        "The staging database is called pg-stage-3",
    )
    # No memory holds every word of these questions (AND would find nothing); one shares a stem.
    assert await contents(caller, "which language does Alice prefer?", mode=TEXT) == [
        "Alice prefers answers in French"
    ]
    assert await contents(caller, "when was the deployment rolling?", mode=TEXT) == [
        "The deployments were rolled back on Tuesday"
    ]
    assert await contents(caller, "what is pg-stage-3", mode=TEXT) == [
        "The staging database is called pg-stage-3"
    ]


async def test_stop_words_alone_match_nothing(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("The cat is on the mat", "What it was and what it is")
    assert await caller.search("what is the it was", mode=TEXT) == []


async def test_a_rare_shared_term_outranks_a_common_one(launchers: Launchers) -> None:
    caller = launchers.caller()
    common = [f"Caroline talked about the weather on day {i}" for i in range(8)]
    await caller.remember(*common, "Caroline adopted a greyhound")
    found = await caller.search("did Caroline ever adopt a greyhound", mode=TEXT, top_k=3)
    assert found[0].memory.content == "Caroline adopted a greyhound"
    assert found[0].text_rank == 1
    assert found[0].vector_rank == 0
    assert found[0].score > 2 * found[1].score  # idf: the rare term carries it


async def test_text_mode_reports_text_ranks_and_hybrid_reports_both(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("the lighthouse keeper", "a keeper of bees", "nothing related")
    text = await caller.search("lighthouse keeper", mode=TEXT)
    assert [r.text_rank for r in text] == [1, 2]
    hybrid = await caller.search("lighthouse keeper", mode=HYBRID)
    assert len(hybrid) == 3  # the vector ranker contributes the non-matching one too
    top = hybrid[0]
    assert top.memory.content == "the lighthouse keeper"
    assert top.vector_rank >= 1
    assert top.text_rank == 1
    assert [r.text_rank for r in hybrid if r.memory.content == "nothing related"] == [0]
    vector = await caller.search("lighthouse keeper", mode=VECTOR)
    assert {(r.vector_rank, r.text_rank) for r in vector} == {(0, 0)}


async def test_the_default_mode_is_hybrid_for_text_and_vector_for_a_query_vector(
    launchers: Launchers,
) -> None:
    caller = launchers.caller()
    await caller.remember("the lighthouse keeper", "a keeper of bees")
    default = await caller.search("lighthouse keeper")
    assert default == await caller.search("lighthouse keeper", mode=HYBRID)
    assert default[0].text_rank == 1


async def test_a_memory_next_to_a_strong_match_gains_from_it_in_hybrid_mode(
    launchers_on: Callable[..., Awaitable[Launchers]],
) -> None:
    # Remembered in this order: the question's answer is the turn after the one it matches.
    turns = [
        "Melanie: do you still paint on weekends",
        "Caroline: I joined the pottery class downtown",  # shares no word with the question below
        "Melanie: the weather was lovely today",
        "Caroline: my cousin visited from Lisbon",
    ]
    with_neighbours = (await launchers_on()).caller()
    without = (await launchers_on(search_neighbour_weight=0.0)).caller()
    for caller in (with_neighbours, without):
        for turn in turns:  # one call each: creation order is remembering order
            await caller.remember(turn)
    question = "what does Melanie paint on weekends"

    def rank_of_answer(results: list[Any]) -> int:
        return [r.memory.content for r in results].index(turns[1])

    assert rank_of_answer(await with_neighbours.search(question, mode=HYBRID)) < rank_of_answer(
        await without.search(question, mode=HYBRID)
    )


async def test_a_text_search_config_is_pinned_per_memory_space(
    launchers_on: Callable[..., Awaitable[Launchers]],
    start_service: Any,
    dev: DevPaths,
    tmp_path: Path,
    database: SharedDatabase,
) -> None:
    english = await launchers_on()  # default: english
    agent = english.new_agent()
    stemmed = english.caller(agent)
    await stemmed.remember("The deployments were rolled back")
    simple_service = await start_service(text_search_config="simple")
    simple = Launchers(simple_service, dev, tmp_path / "simple")
    unstemmed = simple.caller()
    await unstemmed.remember("The deployments were rolled back")

    assert len(await stemmed.search("deployment rolling", mode=TEXT)) == 1
    assert await unstemmed.search("deployment rolling", mode=TEXT) == []  # simple: no stemming
    assert len(await unstemmed.search("deployments rolled", mode=TEXT)) == 1

    # The english space keeps english on a server whose default is simple, for reads and writes.
    on_simple = english.caller(agent, service=simple_service)
    await on_simple.remember("The releases were shipped")
    assert len(await on_simple.search("deployment rolling release shipping", mode=TEXT)) == 2

    # The serving role cannot re-pin it, nor re-index a row with another configuration.
    try:
        async with connect_as(database.app_credential_dir, database.dsn) as conn, conn.transaction():
            await conn.execute(
                "SELECT set_config('tokensvc.namespace', 'default', true), set_config('tokensvc.agent', $1, true)",
                agent,
            )
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("UPDATE tokensvc.memory_spaces SET text_config = 'simple'")
    finally:
        await simple.aclose()


async def test_a_text_query_with_nul_or_no_words_is_refused_or_empty_never_internal(
    launchers: Launchers,
) -> None:
    caller = launchers.caller()
    await caller.remember("plain memory")
    refused = await caller.fail("SearchMemories", _request("bad\x00query", TEXT))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == ["query_text"]
    assert await caller.search("?!...", mode=TEXT) == []
    assert len(await caller.search("?!...", mode=HYBRID)) == 1  # the vector ranker still answers


def _request(text: str, mode: int) -> Any:
    from tokensvc.v1 import memory_pb2

    return memory_pb2.SearchMemoriesRequest(query_text=text, mode=mode)
