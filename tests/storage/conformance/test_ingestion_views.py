"""What readers see of background ingestion, against every implementation: a document's newest
version (the one on its way in, with the version a search reads meanwhile) in `document_state`
and `list_documents`, deletions that take the ingestions with them, and the queue's counts.

PostgreSQL's queue is every namespace's in a database the session shares: its counts are checked
as changes, or as bounds, never as absolute values.
"""

from __future__ import annotations

import asyncio

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.ingestion_support import (
    LEASE,
    enqueue,
    extraction,
    leased,
    new_runner,
    queued,
    ready,
    searchable_texts,
)
from tests.storage.conformance.support import (
    create_base,
    current_document,
    launcher,
    management,
    new_namespace,
)
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.records import DocumentState

# --- document views ---------------------------------------------------------------------------


async def test_document_state_shows_the_version_on_its_way_in_with_the_searchable_one(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    first = await ready(store, ns, "doc", ["one", "two"], metadata={"tag": "old"})
    assert await current_document(knowledge, management(ns), "kb", "doc") == first
    job = await queued(store, ns, "doc", "newer", metadata={"tag": "new"})

    base, document = await knowledge.document_state(launcher(ns, "kb"), "kb", "doc")

    assert base is not None
    assert base.ref == "kb"
    assert document is not None
    assert (document.version, document.state, document.searchable_version) == (2, DocumentState.PENDING, 1)
    assert (document.metadata, document.chunk_count, document.content_sha256) == (
        {"tag": "new"},
        0,
        job.content_sha256,
    )
    assert await knowledge.document_state(launcher(ns, "other"), "kb", "doc") == (None, None)
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "one"), ("doc", 1, "two")}


async def test_list_documents_shows_each_documents_newest_version_with_ingestion_only_ones(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    await ready(store, ns, "a", ["alpha"], metadata={"tag": "old"})
    await ready(store, ns, "b", ["beta"], metadata={"tag": "old"})
    await queued(store, ns, "b", "beta two", metadata={"tag": "new"})
    await queued(store, ns, "c", "gamma", metadata={"tag": "new"})
    failing = await queued(store, ns, "d", "delta")
    runner = new_runner()
    await leased(store, failing, runner)
    await store.fail(failing, runner, "unreadable")
    tenant = management(ns)

    listed = await knowledge.list_documents(tenant, "kb", after=None, limit=10, filter_=None)

    assert listed is not None
    assert [(d.ref, d.version, d.state, d.searchable_version) for d in listed] == [
        ("a", 1, DocumentState.READY, 1),
        ("b", 2, DocumentState.PENDING, 1),
        ("c", 1, DocumentState.PENDING, None),
        ("d", 1, DocumentState.FAILED, None),
    ]
    assert [d.failure_reason for d in listed] == ["", "", "", "unreadable"]
    for document in listed:
        assert await current_document(knowledge, tenant, "kb", document.ref) == document
    newer = Condition("tag", Operator.EQ, "new")
    older = Condition("tag", Operator.EQ, "old")
    assert [
        d.ref for d in await knowledge.list_documents(tenant, "kb", after=None, limit=10, filter_=newer) or []
    ] == [
        "b",
        "c",
    ]
    assert [
        d.ref for d in await knowledge.list_documents(tenant, "kb", after=None, limit=10, filter_=older) or []
    ] == ["a"], "the newest version's metadata filters"
    pages = [
        await knowledge.list_documents(tenant, "kb", after=None, limit=2, filter_=None),
        await knowledge.list_documents(tenant, "kb", after="b", limit=1, filter_=None),
        await knowledge.list_documents(tenant, "kb", after="c", limit=2, filter_=None),
        await knowledge.list_documents(tenant, "kb", after="d", limit=2, filter_=None),
    ]
    assert [[d.ref for d in page or []] for page in pages] == [["a", "b"], ["c"], ["d"], []]
    assert [
        d.ref for d in await knowledge.list_documents(tenant, "kb", after="b", limit=10, filter_=newer) or []
    ] == ["c"]


async def test_list_documents_of_a_base_with_only_ingestions_lists_them(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    assert await knowledge.list_documents(management(ns), "kb", after=None, limit=10, filter_=None) == []
    await queued(store, ns, "only", "body")

    listed = await knowledge.list_documents(management(ns), "kb", after=None, limit=10, filter_=None)

    assert [(d.ref, d.state) for d in listed or []] == [("only", DocumentState.PENDING)]
    assert await knowledge.list_documents(management(ns), "never", after=None, limit=10, filter_=None) is None


# --- deletions --------------------------------------------------------------------------------


async def test_deleting_a_document_deletes_its_ingestion(backend: Backend, kb_namespace: str) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    tenant = management(ns)
    await ready(store, ns, "both", ["one", "two", "three"])
    newer = await queued(store, ns, "both", "newer")
    runner = new_runner()
    await leased(store, newer, runner)
    only = await queued(store, ns, "only", "body")

    assert await knowledge.delete_document(tenant, "kb", "both") == 3, "the searchable version's chunks"
    assert await knowledge.delete_document(tenant, "kb", "only") == 0, "no searchable version"
    assert await knowledge.delete_document(tenant, "kb", "never") is None
    assert await knowledge.delete_document(tenant, "kb", "only") is None

    assert (await store.get(newer), await store.get(only)) == (None, None)
    assert not await store.renew(newer, runner, lease_seconds=LEASE), "its runner lost the lease"
    assert await store.store_extraction(newer, runner, extraction(["x"])) is None
    assert await knowledge.list_documents(tenant, "kb", after=None, limit=10, filter_=None) == []
    assert await searchable_texts(knowledge, ns) == set()
    again = await enqueue(store, ns, "both", "newer")
    assert again is not None
    assert again.document.version == 1, "a new document"


async def test_deleting_a_base_deletes_its_ingestions_and_counts_their_documents(backend: Backend) -> None:
    store, knowledge = backend.ingestion, backend.knowledge
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    await ready(store, ns, "a", ["alpha"])
    newer = await queued(store, ns, "a", "alpha two")
    only = await queued(store, ns, "b", "beta")

    assert await knowledge.delete_base(management(ns), "kb") == 2, "a (searchable, newer queued) and b"

    assert (await store.get(newer), await store.get(only)) == (None, None)
    await create_base(knowledge, ns, "kb")
    try:
        assert await knowledge.list_documents(management(ns), "kb", after=None, limit=10, filter_=None) == []
    finally:
        await knowledge.delete_base(management(ns), "kb")


# --- the queue --------------------------------------------------------------------------------


async def test_the_queue_counts_waiting_leased_and_failed_ingestions(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    before = await store.queue()
    waiting = await queued(store, ns, "waiting", "one")
    working = await queued(store, ns, "working", "two")
    failing = await queued(store, ns, "failing", "three")
    runner = new_runner()
    await leased(store, working, runner)
    await leased(store, failing, runner)
    await store.fail(failing, runner, "refused")
    await asyncio.sleep(0.05)

    during = await store.queue()

    assert during.pending + during.processing - (before.pending + before.processing) == 2, "two unfinished"
    assert during.failed - before.failed == 1
    assert during.pending >= 1
    assert during.processing >= 1
    assert during.oldest_seconds >= 0.05, "at least as old as this test's first upload"
    if backend.name == "inprocess":
        assert (during.pending, during.processing, during.failed) == (1, 1, 1)
    await store.discard(failing, runner)
    await store.discard(working, runner)
    await leased(store, waiting, runner)
    await store.discard(waiting, runner)
    after = await store.queue()
    assert after.pending + after.processing == before.pending + before.processing
    assert after.failed == before.failed
    if backend.name == "inprocess":
        assert after.oldest_seconds == 0.0, "none unfinished"
