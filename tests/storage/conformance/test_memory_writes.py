"""MemoryStore writes: insert with deduplication, idempotency keys, updates, deletes, the sweep,
pepper re-bucketing (`move_buckets`), memory spaces, and concurrent writers."""

from __future__ import annotations

import asyncio
import itertools
import uuid

import numpy as np
import pytest

from tests.storage.conformance.support import (
    DIM,
    EMBEDDER,
    NAMESPACE,
    SPACE,
    memory,
    new_bucket,
    new_tenant,
    random_unit,
    sha,
    unit,
    vector_query,
)
from tests.storage.conformance.support import search as run_search
from tokensvc.errors import AlreadyExists
from tokensvc.storage.ports import MemoryStore
from tokensvc.storage.records import EmbedderSpec, MemorySpace, Tenant


async def ids_in(store: MemoryStore, tenant: Tenant, bucket: str) -> list[str]:
    """The live memories of the bucket, oldest first."""
    page = await store.list_page(tenant, bucket, limit=1000, after=None, filter_=None, embedder=EMBEDDER)
    return [record.id for record in reversed(page)]


# --- insert -----------------------------------------------------------------------------------


async def test_insert_stores_every_row_and_reports_each_as_inserted(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [
        memory("the sky is blue", random_unit(rng), metadata={"topic": "sky", "n": 1, "ok": True}, key="k1"),
        memory("grass is green", random_unit(rng), metadata={"ratio": 0.25}),
        memory("snow is white", random_unit(rng), ttl=3600),
    ]

    refs = await memories.insert(tenant, bucket, rows)

    assert sorted((r.id, r.content_sha256, r.idempotency_key, r.inserted) for r in refs) == sorted(
        (r.id, r.content_sha256, r.idempotency_key, True) for r in rows
    )
    sky = await memories.get(tenant, bucket, rows[0].id, EMBEDDER)
    assert sky is not None
    assert (sky.id, sky.content, sky.embedder, sky.expires_at) == (
        rows[0].id,
        "the sky is blue",
        EMBEDDER,
        None,
    )
    assert sky.metadata == {"topic": "sky", "n": 1, "ok": True}
    assert type(sky.metadata["ok"]) is bool
    assert sky.created_at == sky.updated_at
    assert sky.created_at.tzinfo is not None
    grass = await memories.get(tenant, bucket, rows[1].id, EMBEDDER)
    assert grass is not None
    assert grass.metadata == {"ratio": 0.25}
    snow = await memories.get(tenant, bucket, rows[2].id, EMBEDDER)
    assert snow is not None
    assert snow.expires_at is not None
    assert (snow.expires_at - snow.created_at).total_seconds() == pytest.approx(3600, abs=1)
    assert await ids_in(memories, tenant, bucket) == [row.id for row in rows]


async def test_the_items_of_one_insert_are_created_in_order(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(f"item number {i}", random_unit(rng)) for i in range(20)]
    await memories.insert(tenant, bucket, rows)

    records = [await memories.get(tenant, bucket, row.id, EMBEDDER) for row in rows]

    created = [record.created_at for record in records if record is not None]
    assert len(created) == len(rows)
    assert all(a < b for a, b in itertools.pairwise(created)), "later items are newer"


async def test_same_content_in_the_same_bucket_is_stored_once(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("remember the milk", random_unit(rng))
    await memories.insert(tenant, bucket, [first])
    again = memory("remember the milk", random_unit(rng))  # a new id, the same content hash
    other = memory("buy bread", random_unit(rng))

    refs = await memories.insert(tenant, bucket, [again, other])

    by_hash = {ref.content_sha256: ref for ref in refs}
    assert len(refs) == 2, "one ref per row: the fresh one inserted, the duplicate pointing at the original"
    assert (by_hash[sha("remember the milk")].id, by_hash[sha("remember the milk")].inserted) == (
        first.id,
        False,
    )
    assert (by_hash[sha("buy bread")].id, by_hash[sha("buy bread")].inserted) == (other.id, True)
    assert sorted(await ids_in(memories, tenant, bucket)) == sorted([first.id, other.id])


async def test_a_repeated_idempotency_key_returns_the_existing_row(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("pay the rent", random_unit(rng), key="req-1")
    await memories.insert(tenant, bucket, [first])

    refs = await memories.insert(tenant, bucket, [memory("pay the rent", random_unit(rng), key="req-1")])

    assert [(ref.id, ref.idempotency_key, ref.inserted) for ref in refs] == [(first.id, "req-1", False)]
    found = await memories.find_existing(tenant, bucket, [], ["req-1"])
    assert [(ref.id, ref.content_sha256, ref.inserted) for ref in found] == [
        (first.id, sha("pay the rent"), False)
    ]
    assert await ids_in(memories, tenant, bucket) == [first.id]


async def test_content_stored_under_another_key_reports_the_stored_row_and_its_key(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("call the plumber", random_unit(rng), key="monday")

    await memories.insert(tenant, bucket, [first])
    refs = await memories.insert(
        tenant, bucket, [memory("call the plumber", random_unit(rng), key="tuesday")]
    )

    assert [(ref.id, ref.idempotency_key, ref.inserted) for ref in refs] == [(first.id, "monday", False)]
    assert await memories.find_existing(tenant, bucket, [], ["tuesday"]) == []


async def test_an_idempotency_key_reused_for_other_content_inserts_nothing(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    first = memory("water the plants", random_unit(rng), key="req-2")
    await memories.insert(tenant, bucket, [first])

    with pytest.raises(AlreadyExists):
        await memories.insert(
            tenant,
            bucket,
            [
                memory("a fresh memory", random_unit(rng)),
                memory("feed the cat", random_unit(rng), key="req-2"),
            ],
        )

    assert await ids_in(memories, tenant, bucket) == [first.id]
    assert (
        await memories.find_existing(tenant, bucket, [sha("a fresh memory"), sha("feed the cat")], []) == []
    )


async def test_one_key_for_two_contents_within_a_batch_inserts_nothing(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    with pytest.raises(AlreadyExists):
        await memories.insert(
            tenant,
            bucket,
            [
                memory("first words", random_unit(rng), key="twice"),
                memory("other words", random_unit(rng), key="twice"),
            ],
        )

    assert await ids_in(memories, tenant, bucket) == []


async def test_the_same_content_in_another_bucket_is_another_memory(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    other = Tenant(tenant.namespace, tenant.agent, (other_bucket,))
    mine = memory("shared words", random_unit(rng), key="same-key")
    theirs = memory("shared words", random_unit(rng), key="same-key")

    assert (await memories.insert(tenant, bucket, [mine]))[0].inserted
    assert (await memories.insert(other, other_bucket, [theirs]))[0].inserted

    assert [r.id for r in await memories.find_existing(tenant, bucket, [sha("shared words")], [])] == [
        mine.id
    ]
    assert [r.id for r in await memories.find_existing(other, other_bucket, [], ["same-key"])] == [theirs.id]


async def test_expired_content_and_keys_can_be_remembered_again(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    # ttl 0: expired for every later call.
    gone = memory("no longer true", random_unit(rng), key="gone", ttl=0)
    await memories.insert(tenant, bucket, [gone])

    again = memory("no longer true", random_unit(rng), key="gone")
    refs = await memories.insert(tenant, bucket, [again])

    assert [(ref.id, ref.inserted) for ref in refs] == [(again.id, True)]
    assert await ids_in(memories, tenant, bucket) == [again.id]


# --- update -----------------------------------------------------------------------------------


async def test_update_changes_content_metadata_and_expiry(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("the meeting is on monday", random_unit(rng), metadata={"a": 1}, key="meeting")
    await memories.insert(tenant, bucket, [row, memory("the office is in paris", random_unit(rng))])
    new_vector = random_unit(rng)

    updated = await memories.update(
        tenant,
        bucket,
        row.id,
        content=("the meeting is on tuesday", sha("the meeting is on tuesday"), new_vector),
        metadata={"b": "two"},
        ttl_seconds=600,
        embedder=EMBEDDER,
    )

    assert updated is not None
    assert (updated.id, updated.content, updated.metadata) == (
        row.id,
        "the meeting is on tuesday",
        {"b": "two"},
    )
    assert updated.updated_at > updated.created_at
    assert updated.expires_at is not None
    assert (updated.expires_at - updated.updated_at).total_seconds() == pytest.approx(600, abs=1)
    assert await memories.get(tenant, bucket, row.id, EMBEDDER) == updated
    found = await run_search(memories, tenant, bucket, vector_query(new_vector, k=1))
    assert [(c.item.id, round(c.vector_score, 5)) for c in found] == [(row.id, 1.0)]
    assert [
        ref.id for ref in await memories.find_existing(tenant, bucket, [sha("the meeting is on tuesday")], [])
    ] == [row.id]
    assert await memories.find_existing(tenant, bucket, [sha("the meeting is on monday")], []) == []
    assert [ref.id for ref in await memories.find_existing(tenant, bucket, [], ["meeting"])] == [row.id]


async def test_update_of_metadata_alone_keeps_content_and_expiry(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("a lasting memory", random_unit(rng), metadata={"a": 1, "b": 2}, ttl=3600)
    await memories.insert(tenant, bucket, [row])
    before = await memories.get(tenant, bucket, row.id, EMBEDDER)
    assert before is not None

    updated = await memories.update(
        tenant, bucket, row.id, content=None, metadata={"c": True}, ttl_seconds=None, embedder=EMBEDDER
    )

    assert updated is not None
    assert (updated.content, updated.metadata, updated.expires_at, updated.created_at) == (
        "a lasting memory",
        {"c": True},
        before.expires_at,
        before.created_at,
    )
    assert updated.updated_at > before.updated_at


async def test_update_to_another_memorys_content_is_already_exists_and_changes_nothing(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("the meeting is on monday", random_unit(rng))
    await memories.insert(tenant, bucket, [row, memory("the office is in paris", random_unit(rng))])

    with pytest.raises(AlreadyExists) as raised:
        await memories.update(
            tenant,
            bucket,
            row.id,
            content=("the office is in paris", sha("the office is in paris"), random_unit(rng)),
            metadata={"changed": True},
            ttl_seconds=None,
            embedder=EMBEDDER,
        )

    assert raised.value.field == "content"
    unchanged = await memories.get(tenant, bucket, row.id, EMBEDDER)
    assert unchanged is not None
    assert (unchanged.content, unchanged.metadata) == ("the meeting is on monday", {})


async def test_update_to_the_content_of_an_expired_memory_succeeds(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    row = memory("the meeting is on monday", random_unit(rng))
    await memories.insert(tenant, bucket, [row, memory("the office is in paris", random_unit(rng), ttl=0)])

    updated = await memories.update(
        tenant,
        bucket,
        row.id,
        content=("the office is in paris", sha("the office is in paris"), random_unit(rng)),
        metadata=None,
        ttl_seconds=None,
        embedder=EMBEDDER,
    )

    assert updated is not None
    assert updated.content == "the office is in paris"
    assert [
        ref.id for ref in await memories.find_existing(tenant, bucket, [sha("the office is in paris")], [])
    ] == [row.id]


async def test_update_of_a_missing_id_is_none(memories: MemoryStore, tenant: Tenant, bucket: str) -> None:
    assert (
        await memories.update(
            tenant, bucket, str(uuid.uuid4()), content=None, metadata={}, ttl_seconds=5, embedder=EMBEDDER
        )
        is None
    )


# --- deletes ----------------------------------------------------------------------------------


async def test_delete_removes_the_listed_live_rows_and_counts_them(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    rows = [memory(f"row {i}", random_unit(rng)) for i in range(5)]
    expired = memory("an expired row", random_unit(rng), ttl=0)
    await memories.insert(tenant, bucket, [*rows, expired])

    assert (
        await memories.delete(
            tenant, bucket, [rows[0].id, rows[3].id, rows[3].id, expired.id, str(uuid.uuid4())]
        )
        == 2
    )
    assert await memories.delete(tenant, bucket, [rows[0].id]) == 0
    assert await ids_in(memories, tenant, bucket) == [rows[1].id, rows[2].id, rows[4].id]


async def test_delete_all_empties_the_bucket_counting_live_rows_and_touches_nothing_else(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    other_bucket = new_bucket()
    other = Tenant(tenant.namespace, tenant.agent, (other_bucket,))
    await memories.insert(tenant, bucket, [memory(f"mine {i}", random_unit(rng)) for i in range(4)])
    await memories.insert(tenant, bucket, [memory("mine, expired", random_unit(rng), ttl=0)])
    theirs = [memory(f"mine {i}", random_unit(rng)) for i in range(2)]  # same contents, another bucket
    await memories.insert(other, other_bucket, theirs)

    assert await memories.delete_all(tenant, bucket) == 4, "the expired row goes too, uncounted"

    assert await ids_in(memories, tenant, bucket) == []
    assert await ids_in(memories, other, other_bucket) == [row.id for row in theirs]
    assert await memories.delete_all(tenant, bucket) == 0
    # Nothing expired is left behind to block the same content and key.
    again = memory("mine, expired", random_unit(rng))
    assert [ref.inserted for ref in await memories.insert(tenant, bucket, [again])] == [True]


async def test_the_sweep_deletes_expired_rows_in_batches_and_leaves_live_ones(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    live = memory("still here", random_unit(rng))
    await memories.insert(
        tenant, bucket, [live, *(memory(f"gone {i}", random_unit(rng), ttl=0) for i in range(5))]
    )

    batches = []
    while (deleted := await memories.sweep_expired(limit=2)) > 0:
        batches.append(deleted)

    assert sum(batches) >= 5, "every expired row of this bucket (and maybe other tests') is swept"
    assert all(1 <= deleted <= 2 for deleted in batches)
    assert await memories.sweep_expired() == 0
    assert await ids_in(memories, tenant, bucket) == [live.id]


# --- pepper rotation --------------------------------------------------------------------------


async def test_move_buckets_moves_rows_into_the_current_bucket_and_drops_duplicates(
    memories: MemoryStore, rng: np.random.Generator
) -> None:
    target, older, oldest = new_bucket(3), new_bucket(2), new_bucket(1)
    tenant = new_tenant(target, older, oldest)
    kept = memory("in the target already", random_unit(rng), key="k-target")
    await memories.insert(tenant, target, [kept, memory("expired in the target", random_unit(rng), ttl=0)])
    moved_older = [
        memory("only in older", random_unit(rng), key="k-older", metadata={"from": "older"}),
        memory("in both older buckets", random_unit(rng)),
        memory("expired in the target", random_unit(rng)),  # live here: must survive the move
    ]
    await memories.insert(
        tenant,
        older,
        [
            *moved_older,
            memory("in the target already", random_unit(rng)),  # same content as a target row
            memory("other content, the target's key", random_unit(rng), key="k-target"),
        ],
    )
    only_oldest = memory("only in oldest", random_unit(rng))
    await memories.insert(
        tenant,
        oldest,
        [
            only_oldest,
            memory("in both older buckets", random_unit(rng)),  # duplicate of a row moved from `older`
            memory("expired in oldest", random_unit(rng), ttl=0),
        ],
    )
    before = await memories.get(tenant, older, moved_older[0].id, EMBEDDER)

    assert await memories.move_buckets(tenant, target, [older, oldest]) == 4

    assert sorted(await ids_in(memories, tenant, target)) == sorted(
        [kept.id, only_oldest.id, *(row.id for row in moved_older)]
    )
    assert await ids_in(memories, tenant, older) == []
    assert await ids_in(memories, tenant, oldest) == []
    current = Tenant(tenant.namespace, tenant.agent, (target,))
    after = await memories.get(current, target, moved_older[0].id, EMBEDDER)
    assert after == before, "a moved row keeps its id, content, metadata and timestamps"
    found = await memories.find_existing(current, target, [sha("only in older")], ["k-target", "k-older"])
    assert sorted(ref.id for ref in found) == sorted([moved_older[0].id, kept.id])
    assert await memories.move_buckets(tenant, target, [older, oldest]) == 0


async def test_move_buckets_never_reaches_a_bucket_the_tenant_did_not_declare(
    memories: MemoryStore, rng: np.random.Generator
) -> None:
    target, foreign = new_bucket(2), new_bucket(1)
    owner = new_tenant(foreign)
    theirs = memory("not yours", random_unit(rng))
    await memories.insert(owner, foreign, [theirs])

    assert await memories.move_buckets(new_tenant(target), target, [foreign]) == 0

    assert await ids_in(memories, owner, foreign) == [theirs.id]


async def test_move_buckets_ignores_the_target_among_its_sources(
    memories: MemoryStore, rng: np.random.Generator
) -> None:
    target, older = new_bucket(2), new_bucket(1)
    tenant = new_tenant(target, older)
    kept = [memory(f"current {i}", random_unit(rng)) for i in range(2)]
    await memories.insert(tenant, target, kept)
    moved = memory("older", random_unit(rng))
    await memories.insert(tenant, older, [moved])

    assert await memories.move_buckets(tenant, target, [target, older, older]) == 1

    assert sorted(await ids_in(memories, tenant, target)) == sorted([*(row.id for row in kept), moved.id])


# --- memory spaces ----------------------------------------------------------------------------


async def test_a_space_is_pinned_once_and_visible_only_to_its_agent(
    memories: MemoryStore, tenant: Tenant
) -> None:
    assert await memories.get_space(tenant) is None

    assert await memories.pin_space(tenant, SPACE) == SPACE
    other_choice = MemorySpace(EmbedderSpec("openai", "other-model", DIM * 2, True), "english")
    assert await memories.pin_space(tenant, other_choice) == SPACE

    assert await memories.get_space(tenant) == SPACE
    assert await memories.get_space(Tenant(tenant.namespace, f"{tenant.agent}-other")) is None
    assert await memories.get_space(Tenant(f"{NAMESPACE}-other", tenant.agent)) is None
    elsewhere = Tenant(tenant.namespace, f"{tenant.agent}-other")
    assert await memories.pin_space(elsewhere, other_choice) == other_choice


# --- concurrency ------------------------------------------------------------------------------


async def test_concurrent_inserts_of_the_same_content_store_one_row(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    attempts = [memory("said at the same time", random_unit(rng)) for _ in range(6)]

    results = await asyncio.gather(*(memories.insert(tenant, bucket, [row]) for row in attempts))

    refs = [ref for result in results for ref in result]
    winners = [ref for ref in refs if ref.inserted]
    assert len(winners) == 1
    assert {ref.id for ref in refs} == {winners[0].id}
    assert await ids_in(memories, tenant, bucket) == [winners[0].id]


async def test_concurrent_inserts_of_one_key_with_other_contents_store_one_row(
    memories: MemoryStore, tenant: Tenant, bucket: str, rng: np.random.Generator
) -> None:
    attempts = [memory(f"content number {i}", random_unit(rng), key="contended") for i in range(6)]

    results = await asyncio.gather(
        *(memories.insert(tenant, bucket, [row]) for row in attempts), return_exceptions=True
    )

    stored = [r for r in results if not isinstance(r, BaseException)]
    assert len(stored) == 1
    assert all(isinstance(r, AlreadyExists) for r in results if isinstance(r, BaseException))
    assert await ids_in(memories, tenant, bucket) == [stored[0][0].id]


async def test_concurrent_moves_move_each_row_once(memories: MemoryStore, rng: np.random.Generator) -> None:
    target, older = new_bucket(2), new_bucket(1)
    tenant = new_tenant(target, older)
    rows = [memory(f"old memory {i}", unit(rng.standard_normal(DIM))) for i in range(10)]
    await memories.insert(tenant, older, rows)

    moved = await asyncio.gather(*(memories.move_buckets(tenant, target, [older]) for _ in range(4)))

    assert sum(moved) == 10
    assert sorted(await ids_in(memories, tenant, target)) == sorted(row.id for row in rows)
