"""RevocationStore and AuditStore: idempotent revocations read by window and in full, and the
append-only audit trail paged newest first with its filters.

PostgreSQL's tables are shared by the whole session: every test revokes fresh values and audits
fresh kinds, and asserts about those only.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from tests.storage.conformance.conftest import Backend
from tokensvc.storage.records import AuditRecord


def fresh(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex}"


# --- revocations ------------------------------------------------------------------------------


async def test_revoking_twice_keeps_the_first_revocation(backend: Backend) -> None:
    store, value = backend.revocations, fresh("jti")

    first = await store.revoke("jti", value, reason="leaked", revoked_by="admin-1")
    again = await store.revoke("jti", value, reason="another reason", revoked_by="admin-2")

    assert again == first
    assert first.tzinfo is not None
    mine = [r for r in (await store.all()).revocations if r.value == value]
    assert [(r.kind, r.value, r.revoked_at) for r in mine] == [("jti", value, first)]


async def test_a_listener_hears_of_every_new_revocation_once_it_is_recorded(backend: Backend) -> None:
    store = backend.revocations
    heard: list[tuple[str, str]] = []
    feed = await store.listen(lambda kind, value: heard.append((kind, value)))
    try:
        assert feed.is_open
        before = fresh("before")
        jti, run = fresh("jti"), fresh("run")
        await store.revoke("jti", jti, reason="", revoked_by="admin")
        await store.revoke("run", run, reason="", revoked_by="admin")
        for _ in range(100):  # PostgreSQL announces at commit, asynchronously
            if {("jti", jti), ("run", run)} <= set(heard):
                break
            await asyncio.sleep(0.05)
        assert {("jti", jti), ("run", run)} <= set(heard)
        assert ("jti", before) not in heard
    finally:
        await feed.close()
    assert not feed.is_open
    after = fresh("after")
    await store.revoke("jti", after, reason="", revoked_by="admin")
    await asyncio.sleep(0.2)
    assert ("jti", after) not in heard, "a closed feed announces nothing"


async def test_a_token_id_and_a_run_id_with_the_same_value_are_two_revocations(backend: Backend) -> None:
    store, value = backend.revocations, fresh("same")

    as_jti = await store.revoke("jti", value, reason="", revoked_by="admin")
    as_run = await store.revoke("run", value, reason="", revoked_by="admin")

    assert as_run > as_jti
    assert sorted((r.kind, r.revoked_at) for r in (await store.all()).revocations if r.value == value) == [
        ("jti", as_jti),
        ("run", as_run),
    ]


async def test_since_returns_the_revocations_at_or_after_the_moment(backend: Backend) -> None:
    store = backend.revocations
    values = [fresh(f"r{i}") for i in range(3)]
    times = [await store.revoke("run", value, reason="", revoked_by="admin") for value in values]
    assert times == sorted(times)

    for i, moment in enumerate(times):
        window = {r.value: r.revoked_at for r in (await store.since(moment)).revocations if r.value in values}
        assert window == dict(zip(values[i:], times[i:], strict=True))


async def test_a_read_reports_the_stores_clock_at_the_read(backend: Backend) -> None:
    store = backend.revocations
    before = await store.since(datetime.max.replace(tzinfo=UTC))
    assert before.revocations == ()
    assert before.as_of.tzinfo is not None
    value = fresh("jti")
    revoked_at = await store.revoke("jti", value, reason="", revoked_by="admin")
    window, everything = await store.since(before.as_of), await store.all()
    assert before.as_of <= revoked_at <= window.as_of <= everything.as_of
    # Where the next window starts: a read from `as_of` on holds only what was revoked after it.
    assert value in {r.value for r in window.revocations}
    assert value not in {r.value for r in (await store.since(window.as_of)).revocations}


async def test_find_reads_back_only_recorded_revocations(backend: Backend) -> None:
    store = backend.revocations
    jti, run, never = fresh("jti"), fresh("run"), fresh("never")
    jti_at = await store.revoke("jti", jti, reason="", revoked_by="admin")
    run_at = await store.revoke("run", run, reason="", revoked_by="admin")

    found = await store.find([("jti", jti), ("run", run), ("jti", never), ("run", jti), ("jti", jti)])

    assert sorted((r.kind, r.value, r.revoked_at) for r in found) == [
        ("jti", jti, jti_at),
        ("run", run, run_at),
    ]
    assert await store.find([]) == []
    assert await store.find([("jti", never)]) == []


async def test_concurrent_revocations_of_one_value_agree_on_its_time(backend: Backend) -> None:
    store, value = backend.revocations, fresh("jti")

    times = await asyncio.gather(
        *(store.revoke("jti", value, reason="", revoked_by=f"a{i}") for i in range(5))
    )

    assert len(set(times)) == 1
    assert len([r for r in (await store.all()).revocations if r.value == value]) == 1


# --- audit ------------------------------------------------------------------------------------


async def append(backend: Backend, kind: str, n: int = 0, *, detail: str = "") -> int:
    return await backend.audit.append(
        kind=kind,
        actor=f"spiffe://test/actor-{n}",
        action=f"action {n}",
        target=f"target-{n}",
        outcome="succeeded",
        reason="",
        detail=detail,
    )


async def mine(
    backend: Backend, kinds: list[str], *, since: datetime | None = None, until: datetime | None = None
) -> list[AuditRecord]:
    """Every event of these kinds (newest first) through pages of two."""
    seen: list[AuditRecord] = []
    before = None
    while True:
        page = await backend.audit.page(
            before_id=before,
            kinds=kinds,
            since=since,
            until=until,
            limit=2,
        )
        seen += page
        if len(page) < 2:
            return seen
        before = page[-1].id


async def test_appended_events_get_increasing_ids_and_keep_their_fields(backend: Backend) -> None:
    kind = fresh("kind")

    ids = [await append(backend, kind, n, detail=f"detail {n}") for n in range(3)]

    assert ids == sorted(ids)
    assert len(set(ids)) == 3
    events = await mine(backend, [kind])
    assert [e.id for e in events] == ids[::-1]
    newest = events[0]
    assert (
        newest.kind,
        newest.actor,
        newest.action,
        newest.target,
        newest.outcome,
        newest.reason,
        newest.detail,
    ) == (
        kind,
        "spiffe://test/actor-2",
        "action 2",
        "target-2",
        "succeeded",
        "",
        "detail 2",
    )
    assert newest.occurred_at.tzinfo is not None
    assert [e.occurred_at for e in events] == sorted((e.occurred_at for e in events), reverse=True)


async def test_details_are_cut_to_2048_characters(backend: Backend) -> None:
    kind = fresh("kind")

    await append(backend, kind, detail="x" * 5000)

    assert [len(e.detail) for e in await mine(backend, [kind])] == [2048]


async def test_pages_filter_by_kind_cursor_and_time_window(backend: Backend) -> None:
    first_kind, second_kind = fresh("first"), fresh("second")
    ids = [await append(backend, first_kind if n % 2 == 0 else second_kind, n) for n in range(6)]
    events = {e.id: e for e in await mine(backend, [first_kind, second_kind])}
    assert sorted(events) == ids
    at = [events[i].occurred_at for i in ids]

    assert [e.id for e in await mine(backend, [first_kind])] == [ids[4], ids[2], ids[0]]
    assert [e.id for e in await mine(backend, [first_kind, second_kind], since=at[2], until=at[5])] == [
        ids[4],
        ids[3],
        ids[2],
    ]
    page = await backend.audit.page(
        before_id=ids[3], kinds=[first_kind, second_kind], since=None, until=None, limit=10
    )
    assert [e.id for e in page] == [ids[2], ids[1], ids[0]]
    # No kinds: every kind, so other events may follow ours; ours come first, newest first.
    everything = await backend.audit.page(before_id=ids[5] + 1, kinds=[], since=at[0], until=None, limit=6)
    assert [e.id for e in everything] == ids[::-1]
    assert (
        await backend.audit.page(before_id=None, kinds=[first_kind], since=at[5], until=None, limit=5) == []
    )


async def test_concurrent_appends_get_distinct_ids(backend: Backend) -> None:
    kind = fresh("kind")

    ids = await asyncio.gather(*(append(backend, kind, n) for n in range(8)))

    assert len(set(ids)) == 8
    assert sorted(e.id for e in await mine(backend, [kind])) == sorted(ids)
