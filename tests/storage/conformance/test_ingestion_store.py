"""IngestionStore, against every implementation: uploads queued durably (one version per
document on its way in), leased work fenced by the runner's unexpired lease, progress that counts
each chunk once, and the version's swap into the knowledge store in one step.

Claims and leases, and concurrent writers: `test_ingestion_leases.py`; document views, the
queue's counts and deletions: `test_ingestion_views.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import pytest

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.ingestion_support import (
    LEASE,
    embed_all,
    enqueue,
    extraction,
    ingest,
    leased,
    new_runner,
    queued,
    ready,
    searchable_texts,
    vectors_of,
)
from tests.storage.conformance.support import (
    DIM,
    axis,
    create_base,
    current_document,
    launcher,
    management,
    new_namespace,
    upload,
    vector_query,
)
from tests.storage.conformance.test_embedding_migrations import claim as claim_migration
from tests.storage.conformance.test_knowledge_migrations import planned
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.ingestion_records import Extracted, Ingestion, IngestionState
from tokensvc.storage.ports import IngestionStore, StaleKnowledgeBases
from tokensvc.storage.records import DocumentState, Location, SourceSpan
from tokensvc.storage.reembedding_records import MigrationState

# --- uploads ----------------------------------------------------------------------------------


async def test_the_first_upload_queues_version_one_pending_with_nothing_searchable(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    enqueued = await enqueue(store, ns, "doc", "hello world", metadata={"lang": "en"})

    assert enqueued is not None
    job, document = enqueued.ingestion, enqueued.document
    assert job is not None
    assert not enqueued.unchanged
    assert (job.namespace, job.kb_ref, job.doc_ref, job.version) == (ns, "kb", "doc", 1)
    assert (job.state, job.chunks_done, job.chunks_total, job.generation) == (
        IngestionState.PENDING,
        0,
        None,
        None,
    )
    assert (job.failures, job.reason, job.metadata, job.size_bytes) == (0, "", {"lang": "en"}, 11)
    assert (document.state, document.version, document.searchable_version) == (DocumentState.PENDING, 1, None)
    assert (document.chunk_count, document.chunks_done, document.failure_reason) == (0, 0, "")
    assert await current_document(backend.knowledge, management(ns), "kb", "doc") == document
    assert await store.get(job) == job
    runner = new_runner()
    await leased(store, job, runner)
    assert await store.content(job, runner) == b"hello world"
    assert await searchable_texts(backend.knowledge, ns) == set()


async def test_the_same_bytes_again_keep_the_queued_version_and_replace_its_metadata(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    first = await queued(store, ns, "doc", "body", metadata={"v": 1})
    runner = new_runner()
    await leased(store, first, runner)
    working = await store.store_extraction(first, runner, extraction(["body"]))
    assert working is not None

    again = await enqueue(store, ns, "doc", "body", metadata={"v": 1})
    retagged = await enqueue(store, ns, "doc", "body", metadata={"v": 2})

    assert again is not None
    assert retagged is not None
    assert again.unchanged
    assert retagged.unchanged
    assert again.ingestion == working, "nothing new: the working version, as it is"
    assert retagged.ingestion is not None
    assert (retagged.ingestion.id, retagged.ingestion.version) == (first.id, 1)
    assert retagged.ingestion.metadata == {"v": 2}
    assert retagged.document.metadata == {"v": 2}
    assert retagged.document.state is DocumentState.PROCESSING
    stored = await store.get(first)
    assert stored is not None
    assert (stored.metadata, stored.state) == ({"v": 2}, IngestionState.PROCESSING)
    assert await store.renew(first, runner, lease_seconds=LEASE), "the runner keeps its lease"


async def test_new_bytes_replace_a_queued_version_with_the_next_one_and_end_its_lease(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    await ready(store, ns, "doc", ["version one"])
    second = await queued(store, ns, "doc", "version two")
    runner = new_runner()
    await leased(store, second, runner)

    enqueued = await enqueue(store, ns, "doc", "version three")

    assert enqueued is not None
    third = enqueued.ingestion
    assert third is not None
    assert not enqueued.unchanged
    assert (second.version, third.version) == (2, 3), "one above every version it had"
    assert third.id != second.id
    assert (enqueued.document.state, enqueued.document.searchable_version) == (DocumentState.PENDING, 1)
    assert await store.get(second) is None
    assert not await store.renew(second, runner, lease_seconds=LEASE)
    assert await store.store_extraction(second, runner, extraction(["version two"])) is None
    assert await store.claim_one(second, runner, lease_seconds=LEASE) is None
    assert await searchable_texts(backend.knowledge, ns) == {("doc", 1, "version one")}


async def test_the_searchable_versions_bytes_drop_a_newer_queued_version(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    await ready(store, ns, "doc", ["the searchable one"], metadata={"tag": "old"})
    newer = await queued(store, ns, "doc", "a newer one")

    enqueued = await enqueue(store, ns, "doc", "the searchable one", metadata={"tag": "kept"})

    assert enqueued is not None
    assert enqueued.unchanged
    assert enqueued.ingestion is None, "nothing to make searchable"
    document = enqueued.document
    assert (document.state, document.version, document.searchable_version) == (DocumentState.READY, 1, 1)
    assert document.metadata == {"tag": "kept"}
    assert await store.get(newer) is None
    assert await current_document(knowledge, management(ns), "kb", "doc") == document
    kept = Condition("tag", Operator.EQ, "kept")
    assert await searchable_texts(knowledge, ns, filter_=kept) == {("doc", 1, "the searchable one")}, (
        "its chunks carry the new metadata"
    )


async def test_the_bytes_of_a_failed_version_queue_the_next_version(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    first = await queued(store, ns, "doc", "unreadable")
    runner = new_runner()
    await leased(store, first, runner)
    assert await store.fail(first, runner, "not a PDF") is not None

    enqueued = await enqueue(store, ns, "doc", "unreadable")

    assert enqueued is not None
    assert not enqueued.unchanged
    assert enqueued.ingestion is not None
    assert (enqueued.ingestion.version, enqueued.ingestion.state) == (2, IngestionState.PENDING)
    assert enqueued.ingestion.id != first.id
    assert await store.get(first) is None


async def test_an_upload_to_a_base_that_is_absent_or_outside_the_roster_queues_nothing(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    assert await enqueue(store, ns, "doc", "body", kb_ref="never") is None
    assert await enqueue(store, ns, "doc", "body", tenant=launcher(ns, "other")) is None
    assert await enqueue(store, new_namespace(), "doc", "body") is None
    assert await current_document(backend.knowledge, management(ns), "kb", "doc") is None
    assert await enqueue(store, ns, "doc", "body", tenant=launcher(ns, "kb")) is not None


async def test_the_same_document_in_two_namespaces_is_queued_twice(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    other = new_namespace()
    await create_base(knowledge, other, "kb")
    try:
        mine = await queued(store, ns, "doc", "same body")
        theirs = await queued(store, other, "doc", "same body")
        assert mine.id != theirs.id
        assert (mine.namespace, theirs.namespace, theirs.version) == (ns, other, 1)
        await ingest(store, theirs, ["same body"])
        assert await store.get(mine) == mine
        assert (
            await current_document(knowledge, management(ns), "kb", "doc") or mine
        ).state is DocumentState.PENDING
        assert await searchable_texts(knowledge, ns) == set()
        assert await searchable_texts(knowledge, other) == {("doc", 1, "same body")}
    finally:
        await knowledge.delete_base(management(other), "kb")


# --- the work ---------------------------------------------------------------------------------


async def test_an_extraction_stages_the_chunks_and_a_new_one_replaces_them(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    assert await store.store_extraction(job, new_runner(), extraction(["a"])) is None

    first = await store.store_extraction(job, runner, extraction(["a", "b", "c"]))
    assert first is not None
    assert (first.state, first.chunks_total, first.chunks_done, first.generation) == (
        IngestionState.PROCESSING,
        3,
        0,
        0,
    )
    assert await store.store_vectors(
        job, runner, vectors_of((await store.unembedded(job, runner, limit=1)) or [])
    )
    document = await current_document(backend.knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert (document.state, document.chunk_count, document.chunks_done) == (DocumentState.PROCESSING, 3, 1)

    second = await store.store_extraction(job, runner, extraction(["x", "y"]))

    assert second is not None
    assert (second.chunks_total, second.chunks_done) == (2, 0)
    assert [c.text for c in await store.unembedded(job, runner, limit=10) or []] == ["x", "y"]


async def test_unembedded_chunks_come_in_chunk_order_as_staged(backend: Backend, kb_namespace: str) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    assert await store.unembedded(job, new_runner(), limit=10) is None, "without the lease: None"
    assert await store.unembedded(job, runner, limit=10) == [], "not extracted: nothing staged"
    texts = [f"part {i}" for i in range(5)]
    chunks = extraction(texts).chunks
    await store.store_extraction(job, runner, extraction(texts))

    assert await store.unembedded(job, runner, limit=3) == list(chunks[:3])
    assert await store.unembedded(job, runner, limit=10) == list(chunks)
    await store.store_vectors(job, runner, vectors_of(chunks[1:3]))
    assert [c.index for c in await store.unembedded(job, runner, limit=10) or []] == [0, 3, 4]


async def test_progress_counts_each_chunk_once_when_a_batch_is_written_twice(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["a", "b", "c"]))
    batch = await store.unembedded(job, runner, limit=2)
    assert batch is not None
    assert await store.record_failure(job, runner, "timeout", pause_after=5) is not None

    once = await store.store_vectors(job, runner, vectors_of(batch))
    twice = await store.store_vectors(job, runner, vectors_of(batch))

    assert once is not None
    assert twice is not None
    assert (once.chunks_done, twice.chunks_done) == (2, 2)
    assert (once.failures, once.reason) == (0, "")
    assert await store.store_vectors(job, new_runner(), vectors_of(batch)) is None
    assert [c.index for c in await store.unembedded(job, runner, limit=10) or []] == [2]


# --- the finish -------------------------------------------------------------------------------


async def test_the_finish_makes_a_new_document_searchable(backend: Backend, kb_namespace: str) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    job = await queued(store, ns, "doc", "body one two", metadata={"lang": "en"})

    document = await ingest(store, job, ["body", "one", "two"])

    assert (document.state, document.version, document.searchable_version) == (DocumentState.READY, 1, 1)
    assert (document.chunk_count, document.chunks_done, document.metadata) == (3, 3, {"lang": "en"})
    assert document.content_type == "text/markdown", "the type the extraction recognised"
    assert document.content_sha256 == job.content_sha256
    assert await current_document(knowledge, management(ns), "kb", "doc") == document
    assert await store.get(job) is None
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "body"), ("doc", 1, "one"), ("doc", 1, "two")}
    assert await knowledge.document_text(management(ns), "kb", "doc", 1) == "body\none\ntwo"
    outcome = await knowledge.search(
        management(ns),
        ["kb"],
        lambda _rows: vector_query(axis(1), k=1),
        row_count=3,
        count_cap=1,
        filter_=None,
        generations=[0],
    )
    (top,) = outcome.candidates
    assert (top.item.chunk_index, top.item.text, top.item.heading_path) == (1, "one", ("Title", "Part 1"))
    assert (top.item.start, top.item.end, top.item.location) == (5, 8, Location(2, 2))


async def test_the_finish_swaps_the_previous_versions_chunks_for_the_new_ones(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    first = await ready(store, ns, "doc", ["old a", "old b"])
    job = await queued(store, ns, "doc", "new")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["new a", "new b", "new c"]))
    await embed_all(store, job, runner)
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "old a"), ("doc", 1, "old b")}, (
        "searches read the previous version until the finish"
    )

    document = await store.finish(job, runner)

    assert document is not None
    assert (document.version, document.chunk_count, document.state) == (2, 3, DocumentState.READY)
    assert document.created_at == first.created_at, "the document's creation: its first version's"
    assert await searchable_texts(knowledge, ns) == {
        ("doc", 2, "new a"),
        ("doc", 2, "new b"),
        ("doc", 2, "new c"),
    }
    assert await knowledge.document_text(management(ns), "kb", "doc", 1) is None
    assert await knowledge.document_text(management(ns), "kb", "doc", 2) == "new a\nnew b\nnew c"
    assert await store.finish(job, runner) is None, "it ended"


async def test_no_finish_without_the_lease_an_extraction_or_every_vector(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    assert await store.finish(job, runner) is None, "not extracted yet"
    await store.store_extraction(job, runner, extraction(["a", "b"]))
    batch = await store.unembedded(job, runner, limit=1)
    await store.store_vectors(job, runner, vectors_of(batch or []))

    assert await store.finish(job, runner) is None, "chunk 1 has no vector"
    await embed_all(store, job, runner)
    assert await store.finish(job, new_runner()) is None, "not its lease"
    stored = await store.get(job)
    assert stored is not None
    assert (stored.state, stored.chunks_done) == (IngestionState.PROCESSING, 2)
    assert await searchable_texts(knowledge, ns) == set()
    assert await store.finish(job, runner) is not None


async def test_an_empty_extraction_finishes_a_version_without_chunks(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "")

    document = await ingest(store, job, [])

    assert (document.version, document.chunk_count, document.state) == (1, 0, DocumentState.READY)


async def test_a_cutover_since_the_extraction_sends_the_ingestion_back_to_pending(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge, migrations = kb_namespace, backend.ingestion, backend.knowledge, backend.migrations
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["a", "b"], generation=0))
    await embed_all(store, job, runner)
    # The base cuts over to another embedder (it has no document yet: nothing to backfill).
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    migration = await claim_migration(migrations, new_runner(), created.id)
    assert await migrations.cut_over(migration, migration.lease_owner or "")

    with pytest.raises(StaleKnowledgeBases):
        await store.finish(job, runner)

    again = await store.get(job)
    assert again is not None
    assert (again.state, again.generation, again.chunks_total, again.chunks_done) == (
        IngestionState.PENDING,
        None,
        None,
        0,
    )
    assert await store.unembedded(job, runner, limit=10) == [], "the old pins' chunks are gone"
    assert await store.content(job, runner) == b"body", "the lease and the bytes stay"
    await store.store_extraction(job, runner, extraction(["a", "b"], generation=1))
    await embed_all(store, job, runner, dim=4)
    document = await store.finish(job, runner)
    assert document is not None
    assert (document.version, document.chunk_count) == (1, 2)
    assert await searchable_texts(knowledge, ns, generation=1, dim=4) == {("doc", 1, "a"), ("doc", 1, "b")}


async def test_vectors_of_other_pins_than_the_bases_send_the_ingestion_back_to_pending(
    backend: Backend, kb_namespace: str
) -> None:
    # A second fence behind the runner's one turn per job: vectors embedded for other pins (a
    # turn of before a cutover) never become the document's chunks.
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["a", "b"], generation=0))
    await embed_all(store, job, runner, dim=DIM + 3)

    with pytest.raises(StaleKnowledgeBases):
        await store.finish(job, runner)

    again = await store.get(job)
    assert again is not None
    assert (again.state, again.generation, again.chunks_done) == (IngestionState.PENDING, None, 0)
    assert await searchable_texts(knowledge, ns) == set()
    await store.store_extraction(job, runner, extraction(["a", "b"], generation=0))
    await embed_all(store, job, runner)
    document = await store.finish(job, runner)
    assert document is not None
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "a"), ("doc", 1, "b")}


async def test_fail_ends_the_version_failed_and_keeps_the_previous_one_searchable(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    await ready(store, ns, "doc", ["searchable"])
    job = await queued(store, ns, "doc", "broken")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["x"]))
    assert await store.fail(job, new_runner(), "not held") is None

    failed = await store.fail(job, runner, "the PDF is encrypted")

    assert failed is not None
    assert (failed.state, failed.reason, failed.version) == (IngestionState.FAILED, "the PDF is encrypted", 2)
    assert await store.fail(job, runner, "again") is None, "its lease released"
    assert await store.unembedded(job, runner, limit=10) is None
    document = await current_document(knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert (document.state, document.version, document.searchable_version) == (DocumentState.FAILED, 2, 1)
    assert document.failure_reason == "the PDF is encrypted"
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "searchable")}


async def test_discard_removes_an_ingestion_its_runner_holds_or_that_failed(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    held = await queued(store, ns, "held", "body")
    runner = new_runner()
    await leased(store, held, runner)
    assert not await store.discard(held, new_runner())
    assert await store.discard(held, runner)
    assert await store.get(held) is None
    assert await current_document(knowledge, management(ns), "kb", "held") is None
    assert not await store.discard(held, runner), "gone already"

    await ready(store, ns, "failing", ["searchable"])
    failing = await queued(store, ns, "failing", "broken")
    await leased(store, failing, runner)
    await store.fail(failing, runner, "refused")
    assert await store.discard(failing, new_runner()), "a failed one: whoever was told why"
    document = await current_document(knowledge, management(ns), "kb", "failing")
    assert document is not None
    assert (document.state, document.version) == (DocumentState.READY, 1)

    expired = await queued(store, ns, "expired", "body")
    await leased(store, expired, runner, lease_seconds=0.05)
    await asyncio.sleep(0.2)
    assert not await store.discard(expired, runner), "a lease that expired holds nothing"
    assert await store.get(expired) is not None


async def test_the_extractions_spans_become_the_documents(backend: Backend, kb_namespace: str) -> None:
    ns, store = kb_namespace, backend.ingestion
    job = await queued(store, ns, "doc", "body")
    runner = new_runner()
    await leased(store, job, runner)
    extracted = extraction(["page one", "page two"])
    spans = (SourceSpan(0, 8, page=1), SourceSpan(9, 17, page=2))
    await store.store_extraction(
        job, runner, Extracted(extracted.text, spans, "application/pdf", extracted.chunks, 0)
    )
    await embed_all(store, job, runner)
    document = await store.finish(job, runner)
    assert document is not None
    assert document.content_type == "application/pdf"
    # A re-chunking migration reads the document's text and spans back.
    created = await backend.migrations.create(planned(ns, "kb"))
    assert created is not None
    migration = await claim_migration(backend.migrations, new_runner(), created.id)
    (pending,) = await backend.migrations.pending_documents(migration, limit=10)
    assert (pending.ref, pending.version, pending.text) == ("doc", 1, "page one\npage two")
    assert tuple(pending.spans) == spans
    assert [c.text for c in pending.chunks] == ["page one", "page two"]
    assert await backend.migrations.cut_over(migration, migration.lease_owner or "") is False


async def test_a_synchronous_upload_meanwhile_ends_the_ingestion_at_its_finish(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge = kb_namespace, backend.ingestion, backend.knowledge
    await ready(store, ns, "doc", ["first"])
    job = await queued(store, ns, "doc", "queued")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, extraction(["queued"]))
    await embed_all(store, job, runner)
    written = await upload(knowledge, ns, "kb", "doc", ["written at once"])
    assert written is not None
    assert written[0].version == 2

    assert await store.finish(job, runner) is None, "a version as new is searchable already"

    assert await store.get(job) is None
    assert await searchable_texts(knowledge, ns) == {("doc", 2, "written at once")}
    document = await current_document(knowledge, management(ns), "kb", "doc")
    assert document is not None
    assert (document.version, document.state) == (2, DocumentState.READY)


async def _embedded_for_both(store: IngestionStore, job: Ingestion, runner: str) -> None:
    """Every staged chunk embedded: the base's with 8 dimensions, the target's with 4."""
    while chunks := await store.unembedded(job, runner, limit=3):
        vectors = [(c, axis(c.index % (4 if c.target else DIM), 4 if c.target else DIM)) for c in chunks]
        assert await store.store_vectors(job, runner, vectors) is not None


def _for_both(own: Sequence[str], target: Sequence[str], migration: str) -> Extracted:
    """The base's chunks and the migration's target chunks (its own cut) of one extraction."""
    base = extraction(own)
    cut = [replace(c, target=True) for c in extraction(target).chunks]
    return replace(base, chunks=[*base.chunks, *cut], migration=migration)


async def test_a_version_finished_while_its_migration_backfills_is_written_for_the_target_too(
    backend: Backend, kb_namespace: str
) -> None:
    """So a migration cuts over while uploads go on: each finished version is migrated already."""
    ns, store, knowledge, migrations = kb_namespace, backend.ingestion, backend.knowledge, backend.migrations
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    job = await queued(store, ns, "doc", "alpha beta")
    runner = new_runner()
    await leased(store, job, runner)
    base = await store.base_of(job, runner)
    assert base is not None
    assert (base.migration_id, base.migrating_to) == (created.id, created.target)

    staged = await store.store_extraction(
        job, runner, _for_both(["alpha", "beta"], ["alpha beta"], created.id)
    )
    assert staged is not None
    assert (staged.chunks_total, staged.migration) == (3, created.id)
    await _embedded_for_both(store, job, runner)
    document = await store.finish(job, runner)

    assert document is not None
    assert (document.version, document.chunk_count) == (1, 2)
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "alpha"), ("doc", 1, "beta")}
    assert await searchable_texts(knowledge, ns, generation=1, dim=4) == {("doc", 1, "alpha beta")}
    # Nothing is left for the migration to backfill: it cuts over.
    migration = await claim_migration(migrations, new_runner(), created.id)
    assert await migrations.pending_documents(migration, limit=10) == []
    assert await migrations.cut_over(migration, migration.lease_owner or "")


async def test_target_chunks_of_a_migration_that_ended_meanwhile_are_dropped_at_the_finish(
    backend: Backend, kb_namespace: str
) -> None:
    ns, store, knowledge, migrations = kb_namespace, backend.ingestion, backend.knowledge, backend.migrations
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    job = await queued(store, ns, "doc", "alpha beta")
    runner = new_runner()
    await leased(store, job, runner)
    await store.store_extraction(job, runner, _for_both(["alpha", "beta"], ["alpha beta"], created.id))
    await _embedded_for_both(store, job, runner)
    cancelled = await migrations.transition(
        created.id, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLING
    )
    assert cancelled is not None

    document = await store.finish(job, runner)

    assert document is not None
    assert document.chunk_count == 2
    assert await searchable_texts(knowledge, ns) == {("doc", 1, "alpha"), ("doc", 1, "beta")}
    assert await searchable_texts(knowledge, ns, generation=1, dim=4) == set()
