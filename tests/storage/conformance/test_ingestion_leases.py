"""IngestionStore's claims and leases, against every implementation: the namespace with fewer
ingestions leased first, then the oldest; busy, leased and failed ones passed over; an expired
lease taken over; failures counted until the ingestion ends FAILED; and concurrent writers of one
document or of the queue serialised.
"""

from __future__ import annotations

import asyncio

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.ingestion_support import (
    LEASE,
    claim_ours,
    embed_all,
    enqueue,
    extraction,
    leased,
    new_runner,
    queued,
    ready,
    searchable_texts,
)
from tests.storage.conformance.support import create_base, current_document, management, new_namespace
from tokensvc.storage.ingestion_records import IngestionState
from tokensvc.storage.records import DocumentState

# --- leases -----------------------------------------------------------------------------------


async def test_a_claim_serves_the_namespace_with_fewer_leased_first_then_the_oldest(backend: Backend) -> None:
    store, knowledge = backend.ingestion, backend.knowledge
    busy, quiet = new_namespace(), new_namespace()
    for namespace in (busy, quiet):
        await create_base(knowledge, namespace, "kb")
    try:
        a1 = await queued(store, busy, "a1", "first")
        a2 = await queued(store, busy, "a2", "second")
        b1 = await queued(store, quiet, "b1", "third")
        ours = {a1.id, a2.id, b1.id}
        runner = new_runner()

        claimed = [await claim_ours(store, runner, ours)]
        claimed.append(await claim_ours(store, runner, ours, busy={a1.id}))
        claimed.append(await claim_ours(store, runner, ours, busy={a1.id, b1.id}))

        assert [c.id if c else None for c in claimed] == [a1.id, b1.id, a2.id], (
            "the quiet namespace's newer upload before the busy one's second"
        )
        assert await claim_ours(store, runner, ours, busy=ours) is None
    finally:
        for namespace in (busy, quiet):
            await knowledge.delete_base(management(namespace), "kb")


async def test_a_claim_passes_over_busy_and_leased_ingestions_and_takes_over_an_expired_lease(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    first, second = new_runner(), new_runner()
    assert await claim_ours(store, first, {job.id}, busy={job.id}) is None, "busy: not given"
    held = await claim_ours(store, first, {job.id})
    assert held is not None
    assert held.id == job.id
    assert await claim_ours(store, second, {job.id}) is None, "leased to another runner"
    again = await claim_ours(store, first, {job.id})
    assert again is not None, "its own lease: given again"
    assert await store.claim_one(job, second, lease_seconds=LEASE) is None

    await leased(store, job, first, lease_seconds=0.05)
    await asyncio.sleep(0.2)
    taken = await claim_ours(store, second, {job.id})

    assert taken is not None
    assert taken.id == job.id
    assert await store.store_extraction(job, first, extraction(["body"])) is None
    assert not await store.renew(job, first, lease_seconds=LEASE), "taken over since it expired"
    assert await store.store_extraction(job, second, extraction(["body"])) is not None


async def test_an_expired_lease_nobody_took_is_renewed(backend: Backend, kb_namespace: str) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner, lease_seconds=0.05)
    await asyncio.sleep(0.2)

    assert await store.unembedded(job, runner, limit=10) is None, "expired: no writes, no reads"
    assert await store.renew(job, runner, lease_seconds=LEASE)
    assert await store.unembedded(job, runner, limit=10) == []
    assert not await store.renew(job, new_runner(), lease_seconds=LEASE)


async def test_a_failed_ingestion_is_never_claimed(backend: Backend, kb_namespace: str) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    failed = await store.fail(job, runner, "refused")
    assert failed is not None

    assert await claim_ours(store, new_runner(), {job.id}) is None
    assert await claim_ours(store, runner, {job.id}) is None
    assert await store.claim_one(job, runner, lease_seconds=LEASE) is None
    assert not await store.renew(job, runner, lease_seconds=LEASE)
    assert await store.get(job) == failed


async def test_record_failure_counts_failures_in_a_row_and_ends_failed_at_pause_after(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    assert await store.record_failure(job, new_runner(), "not held", pause_after=3) is None

    once = await store.record_failure(job, runner, "embedder down", pause_after=3)
    assert once is not None
    assert (once.failures, once.reason, once.state) == (1, "embedder down", IngestionState.PENDING)
    extracted = await store.store_extraction(job, runner, extraction(["a", "b"]))
    assert extracted is not None
    assert (extracted.failures, extracted.reason) == (0, ""), "progress resets the failures"
    await store.record_failure(job, runner, "embedder down", pause_after=2)
    twice = await store.record_failure(job, runner, "embedder still down", pause_after=2)

    assert twice is not None
    assert (twice.failures, twice.reason, twice.state) == (2, "embedder still down", IngestionState.FAILED)
    assert twice.paused
    assert not await store.renew(job, runner, lease_seconds=LEASE), "its lease released"
    assert await store.unembedded(job, runner, limit=10) is None
    document = await current_document(backend.knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert (document.state, document.failure_reason) == (DocumentState.FAILED, "embedder still down")


# --- concurrent writers -----------------------------------------------------------------------


async def test_concurrent_uploads_of_the_same_bytes_queue_one_version(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion

    outcomes = await asyncio.gather(*(enqueue(store, ns, "doc", "same body") for _ in range(6)))

    assert all(outcome is not None for outcome in outcomes)
    assert sorted(outcome.unchanged for outcome in outcomes if outcome is not None) == [False] + [True] * 5
    ids = {
        outcome.ingestion.id for outcome in outcomes if outcome is not None and outcome.ingestion is not None
    }
    assert len(ids) == 1
    document = await current_document(backend.knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert document.version == 1


async def test_concurrent_claims_hand_each_ingestion_to_one_runner(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    jobs = [await queued(store, ns, f"doc-{i}", f"body {i}") for i in range(4)]
    ours = {job.id for job in jobs}

    claimed = await asyncio.gather(*(claim_ours(store, new_runner(), ours) for _ in jobs))

    assert sorted(c.id for c in claimed if c is not None) == sorted(ours), "each to one runner"


async def test_a_finish_and_a_newer_upload_at_once_leave_one_version_searchable_and_the_newer_queued(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    await ready(store, ns, "doc", ["first"])
    job = await queued(store, ns, "doc", "second")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["second"]))
    await embed_all(store, job, runner)

    finished, newer = await asyncio.gather(store.finish(job, runner), enqueue(store, ns, "doc", "third"))

    assert newer is not None
    assert newer.ingestion is not None
    assert newer.ingestion.version == 3
    searchable = 1 if finished is None else 2
    assert await searchable_texts(knowledge, ns) == {("doc", searchable, ["first", "second"][searchable - 1])}
    document = await current_document(knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert (document.version, document.state, document.searchable_version) == (
        3,
        DocumentState.PENDING,
        searchable,
    )
