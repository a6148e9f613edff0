"""MemoryStore reads: get, newest-first paging with cursors and filters, expiry, and tenant
isolation by bucket."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from tests.storage.conformance.support import (
    EMBEDDER,
    counted_rows,
    memory,
    new_bucket,
    random_unit,
    search,
    sha,
    text_query,
    vector_query,
)
from tokensvc.storage.filter_language import AllOf, AnyOf, Condition, Filter, Not, Operator
from tokensvc.storage.ports import MemoryStore
from tokensvc.storage.records import MemoryRecord, Tenant


async def page_through(
    store: MemoryStore, tenant: Tenant, bucket: str, *, limit: int, filter_: Filter | None = None
) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        page = await store.list_page(
            tenant, bucket, limit=limit, after=after, filter_=filter_, embedder=EMBEDDER
        )
        seen += [record.id for record in page]
        if len(page) < limit:
            return seen
        after = (page[-1].created_at, page[-1].id)


async def test_get_returns_the_live_row_and_none_for_an_unknown_id(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("a fact", random_unit(rng), metadata={"k": "v"})
    await memories.insert(tenant, bucket, [row])

    record = await memories.get(tenant, bucket, row.id, "some-embedder")

    assert isinstance(record, MemoryRecord)
    assert (record.id, record.content, record.metadata, record.embedder) == (
        row.id,
        "a fact",
        {"k": "v"},
        "some-embedder",
    )
    assert await memories.get(tenant, bucket, str(uuid.uuid4()), EMBEDDER) is None


async def test_list_page_is_newest_first_and_resumes_strictly_after_the_cursor(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    ids: list[str] = []
    for batch in range(3):  # separate inserts, and rows within one insert
        rows = [
            memory(f"note {batch}-{i}", random_unit(rng), metadata={"even": (batch * 3 + i) % 2 == 0})
            for i in range(3)
        ]
        await memories.insert(tenant, bucket, rows)
        ids += [row.id for row in rows]

    everything = await memories.list_page(
        tenant, bucket, limit=100, after=None, filter_=None, embedder=EMBEDDER
    )

    assert [record.id for record in everything] == ids[::-1]
    keys = [(record.created_at, record.id) for record in everything]
    assert keys == sorted(keys, reverse=True)
    for limit in (1, 2, 4, 9):
        assert await page_through(memories, tenant, bucket, limit=limit) == ids[::-1]
    evens = [record.id for record in everything if record.metadata["even"]]
    assert (
        await page_through(memories, tenant, bucket, limit=2, filter_=Condition("even", Operator.EQ, True))
        == evens
    )
    last = everything[-1]
    assert (
        await memories.list_page(
            tenant, bucket, limit=10, after=(last.created_at, last.id), filter_=None, embedder=EMBEDDER
        )
        == []
    )


async def test_a_cursor_between_rows_of_equal_time_breaks_the_tie_by_id(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(f"row {i}", random_unit(rng)) for i in range(4)]
    await memories.insert(tenant, bucket, rows)
    everything = await memories.list_page(
        tenant, bucket, limit=10, after=None, filter_=None, embedder=EMBEDDER
    )
    second = everything[1]

    # A cursor at the second row's time with the lowest and the highest possible id.
    below = await memories.list_page(
        tenant,
        bucket,
        limit=10,
        after=(second.created_at, str(uuid.UUID(int=0))),
        filter_=None,
        embedder=EMBEDDER,
    )
    above = await memories.list_page(
        tenant,
        bucket,
        limit=10,
        after=(second.created_at, str(uuid.UUID(int=(1 << 128) - 1))),
        filter_=None,
        embedder=EMBEDDER,
    )

    assert [r.id for r in below] == [r.id for r in everything[2:]]
    assert [r.id for r in above] == [r.id for r in everything[1:]]


FILTER_CASES: list[tuple[str, Filter, set[str]]] = [
    ("eq string", Condition("colour", Operator.EQ, "red"), {"red-1", "red-2"}),
    ("eq number is not eq string", Condition("n", Operator.EQ, 1.0), {"red-1"}),
    ("ne skips missing keys", Condition("colour", Operator.NE, "red"), {"blue"}),
    ("in mixes kinds", Condition("n", Operator.IN, values=("2", 3.0, True)), {"blue", "flag"}),
    (
        "nin matches present keys only",
        Condition("colour", Operator.NIN, values=("blue",)),
        {"red-1", "red-2"},
    ),
    ("numbers order numerically", Condition("n", Operator.GT, 1.5), {"blue"}),
    ("strings order by code point", Condition("colour", Operator.LT, "c"), {"blue"}),
    ("booleans never order", Condition("flag", Operator.GTE, False), set()),
    ("true is not 1", Condition("flag", Operator.EQ, True), {"flag"}),
    ("exists", Condition("flag", Operator.EXISTS), {"flag"}),
    ("not of a missing key matches", Not(Condition("colour", Operator.EQ, "red")), {"blue", "flag", "bare"}),
    (
        "all of",
        AllOf((Condition("colour", Operator.EQ, "red"), Condition("n", Operator.LTE, 1.0))),
        {"red-1"},
    ),
    (
        "any of",
        AnyOf((Condition("n", Operator.EQ, 3.0), Condition("flag", Operator.EXISTS))),
        {"blue", "flag"},
    ),
    ("empty all matches everything", AllOf(()), {"red-1", "red-2", "blue", "flag", "bare"}),
    ("empty any matches nothing", AnyOf(()), set()),
]


@pytest.mark.parametrize(
    ("filter_", "expected"), [c[1:] for c in FILTER_CASES], ids=[c[0] for c in FILTER_CASES]
)
async def test_filters_select_by_metadata_with_the_documented_semantics(
    memories: MemoryStore,
    tenant: Tenant,
    bucket: str,
    rng: np.random.Generator,
    filter_: Filter,
    expected: set[str],
) -> None:
    labelled: dict[str, dict[str, Any]] = {
        "red-1": {"colour": "red", "n": 1},
        "red-2": {"colour": "red", "n": "1"},
        "blue": {"colour": "blue", "n": 3},
        "flag": {"flag": True, "n": True},
        "bare": {},
    }
    rows = {label: memory(label, random_unit(rng), metadata=meta) for label, meta in labelled.items()}
    await memories.insert(tenant, bucket, list(rows.values()))
    label_of = {row.id: label for label, row in rows.items()}

    listed = await memories.list_page(
        tenant, bucket, limit=10, after=None, filter_=filter_, embedder=EMBEDDER
    )
    found = await search(memories, tenant, bucket, vector_query(random_unit(rng), k=10), filter_)

    assert {label_of[record.id] for record in listed} == expected
    assert {label_of[c.item.id] for c in found} == expected


async def test_expired_rows_are_never_returned_matched_or_updated(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    query = random_unit(rng)
    live = memory("still true", random_unit(rng), metadata={"kind": "fact"})
    # ttl 0: expired for every later call.
    expired = memory("no longer true", query, metadata={"kind": "fact"}, key="gone", ttl=0)
    await memories.insert(tenant, bucket, [live, expired])

    assert await memories.get(tenant, bucket, expired.id, EMBEDDER) is None
    for exact in (True, False):
        found = await search(memories, tenant, bucket, vector_query(query, k=10, exact=exact))
        assert [c.item.id for c in found] == [live.id]
        found = await search(memories, tenant, bucket, text_query("true", k=10, row_count=2, exact=exact))
        assert [c.item.id for c in found] == [live.id]
        hybrid = text_query("true", k=10, row_count=2, vector=query, exact=exact, neighbours=True)
        found = await search(memories, tenant, bucket, hybrid)
        assert [(c.item.id, c.previous, c.next) for c in found] == [(live.id, None, None)]
    page = await memories.list_page(
        tenant,
        bucket,
        limit=10,
        after=None,
        filter_=Condition("kind", Operator.EQ, "fact"),
        embedder=EMBEDDER,
    )
    assert [record.id for record in page] == [live.id]
    assert await memories.find_existing(tenant, bucket, [expired.content_sha256], ["gone"]) == []
    assert (
        await memories.update(
            tenant,
            bucket,
            expired.id,
            content=None,
            metadata={"kind": "revived"},
            ttl_seconds=3600,
            embedder=EMBEDDER,
        )
        is None
    )
    assert await memories.delete(tenant, bucket, [expired.id]) == 0


async def test_reads_and_writes_never_reach_another_bucket(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    other = Tenant(tenant.namespace, tenant.agent, (other_bucket,))
    theirs = [memory(f"their memory {i}", random_unit(rng), metadata={"i": i}, key=f"k{i}") for i in range(3)]
    await memories.insert(other, other_bucket, theirs)
    mine = memory("my memory", random_unit(rng))
    await memories.insert(tenant, bucket, [mine])
    their_ids = [row.id for row in theirs]

    # The right tenant with my bucket, and the other tenant's ids, contents and keys.
    assert await memories.get(tenant, bucket, their_ids[0], EMBEDDER) is None
    assert await memories.delete(tenant, bucket, [*their_ids, mine.id, str(uuid.uuid4())]) == 1
    assert await memories.delete(other, other_bucket, [mine.id]) == 0
    assert await memories.find_existing(tenant, bucket, [theirs[0].content_sha256], ["k1"]) == []
    assert (
        await memories.update(
            tenant,
            bucket,
            their_ids[1],
            content=None,
            metadata={"i": 99},
            ttl_seconds=None,
            embedder=EMBEDDER,
        )
        is None
    )
    assert (
        await memories.list_page(tenant, bucket, limit=10, after=None, filter_=None, embedder=EMBEDDER) == []
    )
    assert await search(memories, tenant, bucket, vector_query(theirs[0].embedding, k=10)) == []
    assert await search(memories, tenant, bucket, text_query("their memory", k=10, row_count=3)) == []
    assert await counted_rows(memories, tenant, bucket, 100) == 0
    assert await memories.delete_all(tenant, bucket) == 0

    record = await memories.get(other, other_bucket, their_ids[1], EMBEDDER)
    assert record is not None
    assert record.metadata == {"i": 1}
    page = await memories.list_page(
        other, other_bucket, limit=10, after=None, filter_=None, embedder=EMBEDDER
    )
    assert sorted(r.id for r in page) == sorted(their_ids)


async def test_a_bucket_the_tenant_did_not_declare_is_invisible(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("declared only to its owner", random_unit(rng), key="owned")
    await memories.insert(tenant, bucket, [row])
    # Same namespace and agent, the bucket passed as an argument, but not declared.
    stranger = Tenant(tenant.namespace, tenant.agent, (new_bucket(),))

    assert await memories.get(stranger, bucket, row.id, EMBEDDER) is None
    assert (
        await memories.find_existing(stranger, bucket, [sha("declared only to its owner")], ["owned"]) == []
    )
    assert (
        await memories.list_page(stranger, bucket, limit=10, after=None, filter_=None, embedder=EMBEDDER)
        == []
    )
    assert await search(memories, stranger, bucket, vector_query(row.embedding, k=5)) == []
    assert await counted_rows(memories, stranger, bucket, 100) == 0
    assert await memories.delete(stranger, bucket, [row.id]) == 0
    assert await memories.delete_all(stranger, bucket) == 0
    assert (
        await memories.update(
            stranger, bucket, row.id, content=None, metadata={"x": 1}, ttl_seconds=None, embedder=EMBEDDER
        )
        is None
    )

    assert await memories.get(tenant, bucket, row.id, EMBEDDER) is not None
