"""MemoryService end to end over mTLS on the real database: what it stores, finds and refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tests.api.memory_support import (
    Caller,
    Launchers,
    and_,
    bucket_rows,
    count_rows,
    field_filter,
    live_embeddings,
    meta,
    metadata_of,
    pack,
    remember_items,
    snapshot,
    ttl,
)
from tests.support import SharedDatabase, superuser
from tokensvc.app import Service
from tokensvc.embedders import HashEmbedder
from tokensvc.v1 import common_pb2, memory_pb2

Request = Callable[[list[str]], tuple[str, Any]]
LT, GTE, GT, IN = (
    common_pb2.FILTER_OPERATOR_LT,
    common_pb2.FILTER_OPERATOR_GTE,
    common_pb2.FILTER_OPERATOR_GT,
    common_pb2.FILTER_OPERATOR_IN,
)
HYBRID = common_pb2.SEARCH_MODE_HYBRID
VECTOR = common_pb2.SEARCH_MODE_VECTOR
DIMENSION = 384  # the default `hash` embedder's


async def numbered(caller: Caller, count: int) -> list[str]:
    """`count` memories with metadata n = 0..count-1 (and parity), all sharing some words."""
    items = [
        memory_pb2.RememberItem(
            content=f"fact {i} about rivers and word{i} with word{i * 7 % 11}",
            metadata={"n": meta(i), "parity": meta("even" if i % 2 == 0 else "odd")},
        )
        for i in range(count)
    ]
    return await caller.remember(*items)


# --- Remember -----------------------------------------------------------------------------------


async def test_remember_returns_one_id_per_item_in_order(launchers: Launchers) -> None:
    caller = launchers.caller()
    contents = ["the sky is blue", "grass is green", "snow is white"]
    response = await caller.call("Remember", memory_pb2.RememberRequest(items=remember_items(*contents)))
    assert [result.deduplicated for result in response.results] == [False, False, False]
    for result, content in zip(response.results, contents, strict=True):
        got = await caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=result.id))
        assert got.memory.content == content
        assert got.memory.embedder == "hash"
        assert not got.memory.HasField("expires_at")


async def test_same_normalised_content_is_deduplicated_across_calls_and_within_a_batch(
    launchers: Launchers, database: SharedDatabase
) -> None:
    caller = launchers.caller()
    composed, decomposed = "Caf\u00e9 au lait", "  Cafe\u0301 au lait \n"
    [first] = await caller.remember(composed)
    again = await caller.call("Remember", memory_pb2.RememberRequest(items=remember_items(decomposed)))
    assert [(r.id, r.deduplicated) for r in again.results] == [(first, True)]

    batch = await caller.call(
        "Remember", memory_pb2.RememberRequest(items=remember_items("tea", "coffee", " tea ", composed))
    )
    pairs = [(r.id, r.deduplicated) for r in batch.results]
    assert pairs[0][1] is False
    assert pairs[1][1] is False
    assert pairs[2] == (pairs[0][0], True)
    assert pairs[3] == (first, True)
    async with superuser(database) as conn:
        rows = await bucket_rows(conn, await caller.bucket())
    assert sorted(row["content"] for row in rows) == sorted([composed, "tea", "coffee"])


async def test_same_idempotency_key_returns_the_same_memory(launchers: Launchers) -> None:
    caller = launchers.caller()
    item = memory_pb2.RememberItem(content="retry me", idempotency_key="req-42")
    [first] = await caller.remember(item)
    response = await caller.call("Remember", memory_pb2.RememberRequest(items=[item]))
    assert [(r.id, r.deduplicated) for r in response.results] == [(first, True)]


@pytest.mark.parametrize(
    ("earlier", "batch", "field"),
    [
        (["first content"], ["other content"], "items[0].idempotency_key"),
        ([], ["first content", "other content"], "items[1].idempotency_key"),
    ],
    ids=["across-calls", "within-one-batch"],
)
async def test_idempotency_key_reused_for_other_content_is_already_exists_and_stores_nothing(
    launchers: Launchers, database: SharedDatabase, earlier: list[str], batch: list[str], field: str
) -> None:
    # The contract (memory.proto, Remember) says ALREADY_EXISTS naming the item's key.
    caller = launchers.caller()
    await caller.remember("an unrelated memory")
    for content in earlier:
        await caller.remember(memory_pb2.RememberItem(content=content, idempotency_key="key-1"))
    before = await snapshot(database, [caller.agent])
    items = [memory_pb2.RememberItem(content=c, idempotency_key="key-1") for c in batch]
    failure = await caller.fail("Remember", memory_pb2.RememberRequest(items=items))
    assert (failure.code, failure.reason) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS")
    assert failure.metadata["field"] == field
    assert await snapshot(database, [caller.agent]) == before


async def test_content_of_exactly_32_kib_is_accepted(launchers: Launchers) -> None:
    caller = launchers.caller()
    content = "\u00e9" * (16 * 1024)  # 2 bytes each in UTF-8
    [memory_id] = await caller.remember(content)
    got = await caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=memory_id))
    assert got.memory.content == content


# --- bad input: INVALID_ARGUMENT naming the field, nothing stored or lost -------------------------


def remember(*items: memory_pb2.RememberItem) -> Request:
    return lambda ids: ("Remember", memory_pb2.RememberRequest(items=list(items)))


def item(content: str = "a good memory", **fields: Any) -> memory_pb2.RememberItem:
    return memory_pb2.RememberItem(content=content, **fields)


def search(**fields: Any) -> Request:
    if "query_vector" not in fields:
        fields["query_text"] = fields.get("query_text", "rivers")
    return lambda ids: ("SearchMemories", memory_pb2.SearchMemoriesRequest(**fields))


def update(memory_id: str | None = None, **fields: Any) -> Request:
    """UpdateMemory of `memory_id`, or of the first seeded memory."""
    return lambda ids: ("UpdateMemory", memory_pb2.UpdateMemoryRequest(id=memory_id or ids[0], **fields))


def listing(**fields: Any) -> Request:
    return lambda ids: ("ListMemories", memory_pb2.ListMemoriesRequest(**fields))


NAN, INF = float("nan"), float("inf")
BAD_INPUT = [
    ("no-items", remember(), "items"),
    ("257-items", remember(*[item(f"memory {i}") for i in range(257)]), "items"),
    ("empty-content", remember(item("")), "items[0].content"),
    ("blank-content", remember(item(" \n\t ")), "items[0].content"),
    ("content-32KiB+1", remember(item("\u00e9" * (16 * 1024) + "x")), "items[0].content"),
    ("nul-in-content", remember(item("a\x00b")), "items[0].content"),
    ("33-metadata-keys", remember(item(metadata={f"k{i}": meta(i) for i in range(33)})), "items[0].metadata"),
    ("bad-metadata-key", remember(item(metadata={"bad key!": meta(1)})), 'items[0].metadata["bad key!"]'),
    ("nan-metadata", remember(item(metadata={"score": meta(NAN)})), 'items[0].metadata["score"]'),
    ("unset-metadata", remember(item(metadata={"v": common_pb2.MetadataValue()})), 'items[0].metadata["v"]'),
    ("long-metadata", remember(item(metadata={"s": meta("x" * 1025)})), 'items[0].metadata["s"]'),
    ("key-with-space", remember(item(idempotency_key="a b")), "items[0].idempotency_key"),
    ("key-non-ascii", remember(item(idempotency_key="cl\u00e9")), "items[0].idempotency_key"),
    ("key-129-chars", remember(item(idempotency_key="k" * 129)), "items[0].idempotency_key"),
    ("ttl-zero", remember(item(ttl=ttl(0))), "items[0].ttl"),
    ("ttl-negative", remember(item(ttl=ttl(-5))), "items[0].ttl"),
    ("ttl-nanos", remember(item(ttl=ttl(1, 500_000_000))), "items[0].ttl"),
    ("ttl-over-3650-days", remember(item(ttl=ttl(3650 * 86400 + 1))), "items[0].ttl"),
    ("batch-item-2-bad", remember(item("one"), item(""), item("three")), "items[1].content"),
    ("no-query", lambda ids: ("SearchMemories", memory_pb2.SearchMemoriesRequest()), "query"),
    ("blank-query", search(query_text="  "), "query_text"),
    ("query-32KiB+1", search(query_text="q" * (32 * 1024 + 1)), "query_text"),
    ("top-k-101", search(top_k=101), "top_k"),
    ("top-k-negative", search(top_k=-1), "top_k"),
    ("min-score-nan", search(min_score=NAN), "min_score"),
    ("vector-7-bytes", search(query_vector=b"\x00" * 7), "query_vector"),
    ("vector-wrong-dimension", search(query_vector=pack(np.ones(DIMENSION - 1))), "query_vector"),
    ("vector-nan", search(query_vector=pack([NAN] + [1.0] * (DIMENSION - 1))), "query_vector"),
    ("vector-inf", search(query_vector=pack([INF] + [1.0] * (DIMENSION - 1))), "query_vector"),
    ("vector-zero", search(query_vector=pack(np.zeros(DIMENSION))), "query_vector"),
    ("hybrid-vector", search(query_vector=pack(np.ones(DIMENSION)), mode=HYBRID), "mode"),
    ("filter-no-node", search(filter=common_pb2.Filter()), "filter"),
    ("filter-empty-and", search(filter=and_()), "filter.and_filters.filters"),
    ("filter-in-no-values", search(filter=field_filter("n", IN)), "filter.field.values"),
    ("filter-gt-bool", search(filter=field_filter("n", GT, True)), "filter.field.value"),
    ("filter-bad-key", search(filter=field_filter("no way", GT, 1)), "filter.field.key"),
    ("filter-no-operator", search(filter=field_filter("n", 0, 1)), "filter.field.operator"),
    (
        "filter-nested",
        search(filter=and_(field_filter("n", GT, 1), field_filter("n", LT, False))),
        "filter.and_filters.filters[1].field.value",
    ),
    ("get-bad-id", lambda ids: ("GetMemory", memory_pb2.GetMemoryRequest(id="not-a-uuid")), "id"),
    ("forget-no-ids", lambda ids: ("Forget", memory_pb2.ForgetRequest()), "ids"),
    ("forget-bad-id", lambda ids: ("Forget", memory_pb2.ForgetRequest(ids=[ids[0], "x"])), "ids[1]"),
    ("forget-257-ids", lambda ids: ("Forget", memory_pb2.ForgetRequest(ids=ids[:1] * 257)), "ids"),
    ("list-bad-token", listing(page_token="zz"), "page_token"),
    ("list-negative-size", listing(page_size=-1), "page_size"),
    ("update-bad-id", update(memory_id="1234"), "id"),
    ("update-blank-content", update(content=" "), "content"),
    ("update-content-32KiB+1", update(content="y" * (32 * 1024 + 1)), "content"),
    ("update-bad-metadata", update(metadata={"x": common_pb2.MetadataValue()}), 'metadata["x"]'),
    ("update-33-keys", update(metadata={f"new{i}": meta(i) for i in range(32)}), "metadata"),
    ("update-ttl-zero", update(ttl=ttl(0)), "ttl"),
    (
        "update-remove-and-replace",
        update(replace_metadata=True, remove_metadata_keys=["n"]),
        "remove_metadata_keys",
    ),
    (
        "update-remove-and-set",
        update(metadata={"n": meta(2)}, remove_metadata_keys=["n"]),
        "remove_metadata_keys[0]",
    ),
]
TOO_LARGE = {"content-32KiB+1", "long-metadata", "query-32KiB+1", "update-content-32KiB+1"}


@pytest.mark.parametrize(("case", "request_for", "field"), BAD_INPUT, ids=[p[0] for p in BAD_INPUT])
async def test_bad_input_is_invalid_argument_naming_the_field_and_changes_nothing(
    launchers: Launchers, database: SharedDatabase, case: str, request_for: Request, field: str
) -> None:
    caller = launchers.caller()
    ids = await caller.remember(
        memory_pb2.RememberItem(content="rivers run to the sea", metadata={"n": meta(1)}),
        memory_pb2.RememberItem(content="mountains are tall", idempotency_key="k1", ttl=ttl(3600)),
    )
    before = await snapshot(database, [caller.agent])
    rpc, message = request_for(ids)
    failure = await caller.fail(rpc, message)
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, failure
    assert failure.reason == ("PAYLOAD_TOO_LARGE" if case in TOO_LARGE else "INVALID_ARGUMENT")
    assert failure.metadata["field"] == field
    assert failure.field_violations == [field]
    assert await snapshot(database, [caller.agent]) == before


async def test_page_token_reused_with_another_filter_is_invalid_argument(launchers: Launchers) -> None:
    caller = launchers.caller()
    await numbered(caller, 5)
    odd = field_filter("n", GTE, 0)
    first = await caller.call("ListMemories", memory_pb2.ListMemoriesRequest(page_size=2, filter=odd))
    assert first.next_page_token
    other = memory_pb2.ListMemoriesRequest(page_size=2, page_token=first.next_page_token)
    failure = await caller.fail("ListMemories", other)
    assert (failure.code, failure.metadata["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token")


# --- SearchMemories -----------------------------------------------------------------------------


async def test_search_returns_at_most_top_k_best_first(launchers: Launchers) -> None:
    caller = launchers.caller()
    await numbered(caller, 20)
    results = await caller.search("rivers word3", top_k=5, mode=VECTOR)
    assert len(results) == 5
    scores = [r.score for r in results]
    assert scores == sorted(scores, reverse=True)
    assert "word3" in results[0].memory.content
    assert all(r.vector_rank == 0 and r.text_rank == 0 for r in results)  # VECTOR mode
    assert len(await caller.search("rivers")) == 10  # top_k 0 means 10
    assert len(await caller.search("rivers " * 4000, top_k=1)) == 1  # 28 KiB: within the 32 KiB limit


async def test_min_score_drops_results_scoring_below_it(launchers: Launchers) -> None:
    caller = launchers.caller()
    await numbered(caller, 12)
    everything = await caller.search("fact 3 about word3", top_k=100)
    assert len(everything) == 12
    # Cut between two clearly different scores, so float32 rounding cannot move a result.
    cut = next(i for i in range(1, 11) if everything[i].score - everything[i + 1].score > 1e-3)
    threshold = (everything[cut].score + everything[cut + 1].score) / 2
    kept = await caller.search("fact 3 about word3", top_k=100, min_score=threshold)
    assert [r.memory.id for r in kept] == [r.memory.id for r in everything[: cut + 1]]
    assert all(r.score >= threshold for r in kept)


# Both search paths: buckets up to the threshold are scanned exactly, larger ones use the HNSW
# index with iterative scans. The index is shared by every bucket of the dimension (the whole
# session's memories), so its scan budget is raised here to keep the test independent of them.
SEARCH_PATHS = pytest.mark.parametrize(
    "settings",
    [{}, {"memory_exact_search_threshold": 1, "memory_hnsw_max_scan_tuples": 1_000_000}],
    ids=["exact-scan", "hnsw-index"],
)


@SEARCH_PATHS
async def test_filtered_search_returns_min_of_top_k_and_matching(
    launchers_on: Callable[..., Awaitable[Launchers]], settings: dict[str, int]
) -> None:
    caller = (await launchers_on(**settings)).caller()
    await numbered(caller, 30)
    few = await caller.search("rivers", top_k=10, filter=field_filter("n", LT, 7))
    assert sorted(metadata_of(r.memory)["n"] for r in few) == list(range(7))
    many = await caller.search("rivers", top_k=10, filter=field_filter("n", GTE, 5))
    assert len(many) == 10
    assert all(metadata_of(r.memory)["n"] >= 5 for r in many)


@SEARCH_PATHS
async def test_search_agrees_with_exact_inner_products_in_numpy(
    launchers_on: Callable[..., Awaitable[Launchers]], database: SharedDatabase, settings: dict[str, int]
) -> None:
    caller = (await launchers_on(**settings)).caller()
    await numbered(caller, 40)
    ids, matrix, metadata = await live_embeddings(database, await caller.bucket())
    rng = np.random.default_rng(7)
    # Near the data (two memories' mix plus noise), and with continuous scores: no ties.
    for a, b in rng.choice(len(ids), size=(3, 2), replace=False):
        query = matrix[a] + 0.5 * matrix[b] + 0.05 * rng.standard_normal(DIMENSION)
        for only_even in (False, True):
            keep = np.array([not only_even or m["parity"] == "even" for m in metadata])
            scores = np.where(keep, matrix @ (query / np.linalg.norm(query)), -np.inf)
            expected = [ids[i] for i in np.argsort(-scores)[:8]]
            even = field_filter("parity", common_pb2.FILTER_OPERATOR_EQ, "even")
            results = await caller.search(pack(query), top_k=8, **({"filter": even} if only_even else {}))
            got = [r.memory.id for r in results]
            for result in results:
                assert result.score == pytest.approx(scores[ids.index(result.memory.id)], abs=1e-5)
            if not settings:
                assert got == expected
            else:  # the approximate index: as many results, near-perfect recall
                assert len(got) == 8
                assert len(set(got) & set(expected)) >= 7


async def test_text_query_scores_are_cosines_of_the_hash_embeddings(
    launchers: Launchers, database: SharedDatabase
) -> None:
    caller = launchers.caller()
    await numbered(caller, 25)
    _ids, matrix, _ = await live_embeddings(database, await caller.bucket())
    query = "rivers word4 with word6"
    exact = np.sort(matrix @ HashEmbedder().vectorize([query])[0])[::-1][:6]
    results = await caller.search(query, top_k=6, mode=VECTOR)
    assert [r.score for r in results] == pytest.approx(list(exact), abs=1e-5)


async def test_search_by_query_vector_of_the_pinned_dimension(launchers: Launchers) -> None:
    caller = launchers.caller()
    [target, *_] = await caller.remember("penguins live in antarctica", "camels cross deserts", "owls hunt")
    vector = HashEmbedder().vectorize(["penguins live in antarctica"])[0] * 3.0  # any length works
    results = await caller.search(pack(vector), top_k=2)
    assert results[0].memory.id == target
    assert results[0].score == pytest.approx(1.0, abs=1e-5)


async def test_hybrid_fuses_scores_and_reports_a_text_only_match_with_vector_rank_zero(
    launchers: Launchers,
) -> None:
    caller = launchers.caller()
    # 120 memories close to the query's vector (they share three of its words) and one long memory
    # whose one shared word is rare: only the full-text ranker puts it near the top.
    filler = " ".join(f"filler{i}" for i in range(60))
    [lone, *crowd] = await caller.remember(f"quokka {filler}", *[f"apple zebra note {i}" for i in range(120)])
    results = await caller.search("quokka apple zebra note", mode=HYBRID, top_k=60)
    by_id = {r.memory.id: r for r in results}
    assert (by_id[lone].vector_rank, by_id[lone].text_rank) == (0, 1)
    assert all(0.0 <= r.score <= 1.0 for r in results)
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert all(r.vector_rank > 0 or r.text_rank > 0 for r in results)  # each came from a ranker

    both = await caller.search("apple zebra note 7", mode=HYBRID, top_k=3)
    assert both[0].memory.content == "apple zebra note 7"
    assert both[0].vector_rank == 1
    assert both[0].text_rank > 0
    assert lone not in {r.memory.id for r in both}
    assert by_id.keys() <= {lone, *crowd}


# --- ListMemories -------------------------------------------------------------------------------


def sort_key(memory: memory_pb2.Memory) -> tuple[int, int, str]:
    return (memory.created_at.seconds, memory.created_at.nanos, memory.id)


async def test_list_pages_newest_first_through_every_memory_exactly_once(launchers: Launchers) -> None:
    caller = launchers.caller()
    older = await numbered(caller, 8)
    newer = [(await caller.remember(f"later memory {i}"))[0] for i in range(3)]
    pages = await caller.list_pages(page_size=3)
    listed = [memory for page in pages for memory in page]
    assert [len(page) for page in pages] == [3, 3, 3, 2]
    assert sorted(m.id for m in listed) == sorted(older + newer)
    assert listed == sorted(listed, key=sort_key, reverse=True)
    assert [m.id for m in listed[:3]] == newer[::-1]


async def test_list_applies_the_filter_across_pages(launchers: Launchers) -> None:
    caller = launchers.caller()
    ids = await numbered(caller, 11)
    evens = await caller.list_all(
        page_size=2, filter=field_filter("parity", common_pb2.FILTER_OPERATOR_EQ, "even")
    )
    assert sorted(m.id for m in evens) == sorted(ids[0::2])
    assert len(await caller.list_all(page_size=500)) == 11


# --- UpdateMemory -------------------------------------------------------------------------------


async def test_content_update_re_embeds_the_memory(launchers: Launchers, database: SharedDatabase) -> None:
    caller = launchers.caller()
    [memory_id, _] = await caller.remember("the cat sat on the mat", "dogs bark at night")
    response = await caller.call(
        "UpdateMemory",
        memory_pb2.UpdateMemoryRequest(id=memory_id, content=" quantum chromodynamics lecture "),
    )
    assert response.memory.content == "quantum chromodynamics lecture"
    assert response.memory.updated_at.ToDatetime() > response.memory.created_at.ToDatetime()
    found = await caller.search("quantum chromodynamics", top_k=1)
    assert found[0].memory.id == memory_id
    assert found[0].score > 0.5
    ids, matrix, _ = await live_embeddings(database, await caller.bucket())
    expected = HashEmbedder().vectorize(["quantum chromodynamics lecture"])[0]
    np.testing.assert_allclose(matrix[ids.index(memory_id)], expected, atol=1e-6)


async def test_metadata_update_merges_removes_and_replaces(launchers: Launchers) -> None:
    caller = launchers.caller()
    [memory_id] = await caller.remember(remember_items("a fact", lang="en", score=1, keep=True)[0])

    async def update_with(**fields: Any) -> dict[str, Any]:
        request = memory_pb2.UpdateMemoryRequest(id=memory_id, **fields)
        return metadata_of((await caller.call("UpdateMemory", request)).memory)

    merged = await update_with(metadata={"score": meta(2), "new": meta("x")}, remove_metadata_keys=["lang"])
    assert merged == {"score": 2.0, "keep": True, "new": "x"}
    assert await update_with(remove_metadata_keys=["absent"]) == merged
    assert await update_with(metadata={"only": meta(False)}, replace_metadata=True) == {"only": False}
    assert await update_with(replace_metadata=True) == {}
    got = await caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=memory_id))
    assert got.memory.content == "a fact"
    assert metadata_of(got.memory) == {}


async def test_ttl_update_sets_a_new_expiry(launchers: Launchers) -> None:
    caller = launchers.caller()
    [memory_id] = await caller.remember("lives for an hour from now")
    response = await caller.call("UpdateMemory", memory_pb2.UpdateMemoryRequest(id=memory_id, ttl=ttl(3600)))
    lifetime = response.memory.expires_at.ToDatetime() - response.memory.updated_at.ToDatetime()
    assert abs(lifetime.total_seconds() - 3600) < 5


async def test_update_to_another_memorys_content_is_already_exists_and_changes_nothing(
    launchers: Launchers, database: SharedDatabase
) -> None:
    # UpdateMemory does not deduplicate: a collision is a deliberate ALREADY_EXISTS, not INTERNAL.
    caller = launchers.caller()
    [first, second] = await caller.remember("first fact", "second fact")
    before = await snapshot(database, [caller.agent])
    failure = await caller.fail(
        "UpdateMemory", memory_pb2.UpdateMemoryRequest(id=second, content=" first fact")
    )
    assert (failure.code, failure.reason) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS")
    assert failure.metadata["field"] == "content"
    assert await snapshot(database, [caller.agent]) == before
    got = await caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=first))
    assert got.memory.content == "first fact"


# --- expiry, ForgetAll --------------------------------------------------------------------------


async def test_expired_memory_is_returned_before_and_never_after_it_expires(launchers: Launchers) -> None:
    caller = launchers.caller()
    # 3 s: a first write can take over a second on a cold Citus worker connection.
    [short, keeper] = await caller.remember(
        memory_pb2.RememberItem(content="ephemeral otter fact", ttl=ttl(3)), "durable otter fact"
    )
    get = memory_pb2.GetMemoryRequest(id=short)
    stored = (await caller.call("GetMemory", get)).memory
    assert stored.HasField("expires_at")
    assert short in {r.memory.id for r in await caller.search("otter fact")}
    assert short in {m.id for m in await caller.list_all()}
    expires = stored.expires_at.ToDatetime(tzinfo=UTC)
    await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.5)
    assert (await caller.fail("GetMemory", get)).code == grpc.StatusCode.NOT_FOUND
    assert [r.memory.id for r in await caller.search("otter fact")] == [keeper]
    assert [r.memory.id for r in await caller.search("otter", mode=HYBRID)] == [keeper]
    assert [m.id for m in await caller.list_all()] == [keeper]
    refused = await caller.fail("UpdateMemory", memory_pb2.UpdateMemoryRequest(id=short, content="x"))
    assert refused.code == grpc.StatusCode.NOT_FOUND
    assert (await caller.call("Forget", memory_pb2.ForgetRequest(ids=[short]))).forgotten_count == 0
    # The same content can be remembered again: a new memory, not the expired one.
    [fresh] = await caller.remember("ephemeral otter fact")
    assert fresh != short


async def test_sweeper_deletes_expired_memories_from_the_table(
    launchers: Launchers, service: Service, database: SharedDatabase
) -> None:
    caller = launchers.caller()
    [_, keeper] = await caller.remember(memory_pb2.RememberItem(content="brief", ttl=ttl(1)), "stays")
    bucket = await caller.bucket()
    assert await count_rows(database, bucket) == 2
    await asyncio.sleep(1.5)
    assert service.memory is not None
    assert await service.memory.sweep_expired() >= 1
    async with superuser(database) as conn:
        assert [row["id"] for row in await bucket_rows(conn, bucket)] == [keeper]


async def test_forget_all_empties_the_bucket_and_leaves_other_buckets_untouched(
    launchers: Launchers, database: SharedDatabase
) -> None:
    agent = launchers.new_agent()
    doomed = launchers.caller(agent, user="user-x", per_user=True)
    neighbour = launchers.caller(agent, user="user-y", per_user=True)
    agent_wide = launchers.caller(agent)
    await doomed.remember(
        *[f"x memory {i}" for i in range(5)], memory_pb2.RememberItem(content="x", ttl=ttl(60))
    )
    await neighbour.remember("y memory one", "y memory two")
    await agent_wide.remember("agent memory")
    buckets = [await c.bucket() for c in (doomed, neighbour, agent_wide)]
    assert len(set(buckets)) == 3
    before = await snapshot(database, [agent])

    response = await doomed.call("ForgetAll", memory_pb2.ForgetAllRequest())
    assert response.forgotten_count == 6
    assert await count_rows(database, buckets[0]) == 0
    assert [await count_rows(database, b) for b in buckets[1:]] == [2, 1]
    remaining = await snapshot(database, [agent])
    assert remaining == [row for row in before if row[0] != buckets[0]]
    assert (await doomed.call("ForgetAll", memory_pb2.ForgetAllRequest())).forgotten_count == 0
    assert await doomed.remember("x starts over")  # the space stays pinned and usable


# --- the pinned embedder ------------------------------------------------------------------------


async def test_a_changed_embedder_configuration_is_refused_and_new_spaces_pin_the_new_one(
    launchers_on: Callable[..., Awaitable[Launchers]],
    start_service: Any,
    tmp_path: Path,
    database: SharedDatabase,
) -> None:
    pool = await launchers_on()
    config = tmp_path / "embedders.toml"
    config.write_text('[embedders.hash]\nkind = "hash"\ndimension = 256\n')
    second = await start_service(embedders_file=str(config))
    agent = pool.new_agent()
    await pool.caller(agent).remember("pinned to 384 dimensions")
    moved = pool.caller(agent, service=second)
    for rpc, message in [
        ("Remember", memory_pb2.RememberRequest(items=remember_items("another fact"))),
        ("SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="fact")),
    ]:
        failure = await moved.fail(rpc, message)
        assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PINNED_CONFIGURATION")
    assert len(await pool.caller(agent).search("pinned")) == 1  # the first service still serves it

    newcomer = pool.caller(service=second)
    [memory_id] = await newcomer.remember("pinned to 256 dimensions")
    assert (await newcomer.search("256 dimensions"))[0].memory.id == memory_id
    assert (await newcomer.search(pack(np.ones(256))))[0].memory.id == memory_id
    async with superuser(database) as conn:
        dimensions = await conn.fetch(
            "SELECT agent, dimension FROM memory_spaces WHERE agent = ANY($1::text[])",
            [agent, newcomer.agent],
        )
        indexes = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'memories'")
        rows = await bucket_rows(conn, await newcomer.bucket())
    assert {row["agent"]: row["dimension"] for row in dimensions} == {agent: 384, newcomer.agent: 256}
    assert {"memories_hnsw_384", "memories_hnsw_256"} <= {row[0] for row in indexes}
    assert [row["dimension"] for row in rows] == [256]


async def test_a_page_token_with_wrong_value_types_is_invalid_argument_even_without_ltm(
    launchers: Launchers,
) -> None:
    import base64
    import json

    forged = base64.urlsafe_b64encode(
        json.dumps({"c": "2026-01-01T00:00:00+00:00", "i": 1, "f": "x"}).encode()
    ).decode()
    for caller in (launchers.caller(), launchers.caller(ltm=False)):
        failure = await caller.fail("ListMemories", memory_pb2.ListMemoriesRequest(page_token=forged))
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
        assert failure.metadata["field"] == "page_token"
