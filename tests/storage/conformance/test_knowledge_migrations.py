"""EmbeddingMigrationStore over knowledge bases and the generations of KnowledgeStore, against
every implementation.

A migration writes every current document's chunks of the base's next generation; the cutover
switches the base to it only when every document has them, and is ordered with every upload; an
upload for a generation that is gone is refused (`StaleKnowledgeBases`); an upload during the
backfill writes both generations only for the base's backfilling migration.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace

import pytest

from tests.storage.conformance.conftest import Backend
from tests.storage.conformance.support import (
    DIM,
    axis,
    chunk_rows,
    create_base,
    launcher,
    management,
    new_namespace,
    sha,
    upload,
    vector_query,
)
from tests.storage.conformance.test_embedding_migrations import LEASE, TARGET, claim
from tokensvc.storage.ports import EmbeddingMigrationStore, KnowledgeStore, StaleKnowledgeBases
from tokensvc.storage.records import BaseRow, ChunkingSpec, ChunkRow, EmbedderSpec, Location, SourceSpan
from tokensvc.storage.reembedding_records import KnowledgeBaseMigration, MigrationState, PendingDocument

SOURCE = EmbedderSpec("test", "conformance-model", DIM, True)
FIXED = ChunkingSpec("fixed", 64, 0)
SMALLER = ChunkingSpec("fixed", 32, 0)


def planned(namespace: str, kb_ref: str, *, chunking: ChunkingSpec = FIXED) -> KnowledgeBaseMigration:
    return KnowledgeBaseMigration(
        id=str(uuid.uuid4()),
        namespace=namespace,
        kb_ref=kb_ref,
        from_generation=0,
        source=SOURCE,
        target=TARGET,
        source_chunking=FIXED,
        target_chunking=chunking,
        state=MigrationState.BACKFILLING,
        created_by="spiffe://test/admin",
    )


def target_rows(texts: Sequence[str]) -> list[ChunkRow]:
    """The target "model": 4 dimensions, chunk i along axis i mod 4."""
    return [
        ChunkRow(c.index, c.text, c.start, c.end, c.heading_path, axis(c.index % 4, 4))
        for c in chunk_rows(texts)
    ]


async def base_with(knowledge: KnowledgeStore, documents: int) -> tuple[str, BaseRow]:
    ns = new_namespace()
    base = await create_base(knowledge, ns, "kb")
    for d in range(documents):
        await upload_text(knowledge, ns, f"doc-{d}", [f"doc {d} part {i}" for i in range(3)])
    return ns, base


async def upload_text(
    knowledge: KnowledgeStore,
    ns: str,
    doc: str,
    texts: list[str],
    *,
    generation: int = 0,
    chunks: list[ChunkRow] | None = None,
    next_chunks: list[ChunkRow] | None = None,
    migration_id: str | None = None,
    source_spans: tuple[SourceSpan, ...] = (),
) -> None:
    body = "\n".join(texts)
    written = await knowledge.replace_document(
        management(ns),
        kb_ref="kb",
        ref=doc,
        content_type="text/plain",
        content_sha256=sha(body),
        size_bytes=len(body),
        metadata={},
        chunks=chunk_rows(texts) if chunks is None else chunks,
        generation=generation,
        text=body,
        next_chunks=next_chunks,
        migration_id=migration_id,
        source_spans=source_spans,
    )
    assert written is not None


async def texts_of(knowledge: KnowledgeStore, ns: str, generation: int, dim: int = DIM) -> set[str]:
    """Every chunk text a search of generation `generation` finds."""
    outcome = await knowledge.search(
        launcher(ns, "kb"),
        ["kb"],
        lambda _rows: vector_query(axis(0, dim), k=100),
        row_count=100,
        count_cap=1,
        filter_=None,
        generations=[generation],
    )
    return {c.item.text for c in outcome.candidates}


def embedded(documents: Sequence[PendingDocument]) -> list[tuple[PendingDocument, list[ChunkRow]]]:
    """Each pending document's own chunks, embedded by the target."""
    return [
        (
            d,
            [
                ChunkRow(c.index, c.text, c.start, c.end, c.heading_path, axis(c.index % 4, 4), c.location)
                for c in d.chunks
            ],
        )
        for d in documents
    ]


async def backfill(
    store: EmbeddingMigrationStore, migration: KnowledgeBaseMigration, runner: str
) -> KnowledgeBaseMigration:
    while documents := await store.pending_documents(migration, limit=2):
        stored = await store.store_documents(migration, runner, embedded(documents), lease_seconds=LEASE)
        assert stored is not None
        migration = stored
    return migration


async def test_a_base_migration_writes_the_next_generation_and_the_cutover_switches_to_it(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=3)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    assert isinstance(created, KnowledgeBaseMigration)  # a base's, not a space's
    assert (created.kb_ref, created.rows_total, created.rows_done) == ("kb", 3, 0)
    runner = "runner-kb-a"
    migration = await claim(migrations, runner, created.id)
    first = await migrations.pending_documents(migration, limit=2)
    assert [d.ref for d in first] == ["doc-0", "doc-1"]
    assert [c.text for c in first[0].chunks] == ["doc 0 part 0", "doc 0 part 1", "doc 0 part 2"]
    assert first[0].text == "doc 0 part 0\ndoc 0 part 1\ndoc 0 part 2"
    stored = await migrations.store_documents(migration, runner, embedded(first), lease_seconds=LEASE)
    assert stored is not None
    assert (stored.rows_done, stored.document_cursor) == (2, "doc-1")
    assert not await migrations.cut_over(stored, runner), "doc-2 has no next-generation chunks yet"
    migration = await backfill(migrations, stored, runner)
    assert migration.rows_done == 3
    # Before the cutover searches read generation 0 only, which the migration never touched.
    old = {f"doc {d} part {i}" for d in range(3) for i in range(3)}
    assert await texts_of(knowledge, ns, 0) == old
    assert await migrations.cut_over(migration, runner)
    base = (await knowledge.get_bases(management(ns), ["kb"]))[0]
    assert (base.embedder, base.model, base.dimension, base.generation) == (TARGET.name, TARGET.model, 4, 1)
    assert await texts_of(knowledge, ns, 1, dim=4) == old
    # A search whose query was embedded for generation 0 still finds it until the clean-up.
    assert await texts_of(knowledge, ns, 0) == old
    retiring = await migrations.get(created.id)
    assert retiring is not None
    assert retiring.state is MigrationState.RETIRING
    cleared = await migrations.clear_slot(retiring, runner, limit=2, lease_seconds=LEASE)
    assert cleared is not None
    assert cleared[0] == 6, "two documents' three chunks each"
    while cleared[0]:
        cleared = await migrations.clear_slot(cleared[1], runner, limit=2, lease_seconds=LEASE)
        assert cleared is not None
    assert await texts_of(knowledge, ns, 0) == set()
    assert await texts_of(knowledge, ns, 1, dim=4) == old


async def test_a_re_chunking_migration_cuts_the_stored_text_and_takes_the_new_chunk_counts(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    created = await migrations.create(planned(ns, "kb", chunking=SMALLER))
    assert created is not None
    assert created.rechunks
    runner = "runner-kb-b"
    migration = await claim(migrations, runner, created.id)
    (document,) = await migrations.pending_documents(migration, limit=10)
    assert document.chunks == (), "a re-chunking migration cuts the text itself"
    assert document.text == "doc 0 part 0\ndoc 0 part 1\ndoc 0 part 2"
    stored = await migrations.store_documents(
        migration,
        runner,
        [(document, target_rows(["doc 0", "part 0 doc 0 part 1 doc 0 part 2"]))],
        lease_seconds=LEASE,
    )
    assert stored is not None
    assert await migrations.cut_over(stored, runner)
    base = (await knowledge.get_bases(management(ns), ["kb"]))[0]
    assert (base.chunking, base.chunk_size, base.chunk_overlap) == ("fixed", 32, 0)
    (current,) = (
        await knowledge.list_documents(management(ns), "kb", after=None, limit=10, filter_=None) or []
    )
    assert current.chunk_count == 2
    assert await texts_of(knowledge, ns, 1, dim=4) == {"doc 0", "part 0 doc 0 part 1 doc 0 part 2"}


async def test_uploads_during_the_backfill_write_both_generations_only_for_the_backfilling_migration(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    base, _ = await knowledge.document_state(management(ns), "kb", "doc-0")
    assert base is not None
    assert (base.migration_id, base.migrating_to, base.migrating_chunking) == (created.id, TARGET, FIXED)
    runner = "runner-kb-c"
    migration = await claim(migrations, runner, created.id)
    # Written for the migration: done for it, never pending.
    await upload_text(
        knowledge, ns, "dual", ["dual one"], next_chunks=target_rows(["dual one"]), migration_id=created.id
    )
    # A replica that did not know of the migration: pending; one naming another id: dropped.
    await upload_text(knowledge, ns, "plain", ["plain one"])
    await upload_text(
        knowledge,
        ns,
        "other",
        ["other one"],
        next_chunks=target_rows(["other one"]),
        migration_id=str(uuid.uuid4()),
    )
    pending = {d.ref for d in await migrations.pending_documents(migration, limit=10)}
    assert pending == {"doc-0", "plain", "other"}
    # A new version of a migrated document is pending again.
    migration = await backfill(migrations, migration, runner)
    await upload_text(knowledge, ns, "doc-0", ["doc 0 rewritten"])
    assert [d.ref for d in await migrations.pending_documents(replace_cursor(migration), limit=10)] == [
        "doc-0"
    ]
    migration = await backfill(migrations, replace_cursor(migration), runner)
    assert await migrations.cut_over(migration, runner)
    assert await texts_of(knowledge, ns, 1, dim=4) == {
        "doc 0 rewritten",
        "dual one",
        "plain one",
        "other one",
    }


def replace_cursor(migration: KnowledgeBaseMigration) -> KnowledgeBaseMigration:
    """The migration with its cursor back at the start (what a rewind does)."""
    return replace(migration, document_cursor=None)


async def test_an_upload_for_a_generation_that_is_gone_is_refused_and_writes_nothing(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    runner = "runner-kb-d"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    assert await migrations.cut_over(migration, runner)
    with pytest.raises(StaleKnowledgeBases):
        await upload_text(knowledge, ns, "late", ["late text"], generation=0)
    _, document = await knowledge.document_state(management(ns), "kb", "late")
    assert document is None
    await upload_text(knowledge, ns, "late", ["late text"], generation=1, chunks=target_rows(["late text"]))
    assert "late text" in await texts_of(knowledge, ns, 1, dim=4)


async def test_a_cancelled_base_migration_removes_its_generation_and_changes_nothing_searched(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=2)
    before = await texts_of(knowledge, ns, 0)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    assert await migrations.create(planned(ns, "kb")) is None, "one migration of a base at a time"
    runner = "runner-kb-e"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    cancelling = await migrations.transition(
        created.id, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLING
    )
    assert cancelling is not None
    # An upload that still believes in the migration writes the current generation only.
    await upload_text(
        knowledge, ns, "late", ["late"], next_chunks=target_rows(["late"]), migration_id=created.id
    )
    migration = await claim(migrations, runner, created.id)
    while (
        cleared := await migrations.clear_slot(migration, runner, limit=3, lease_seconds=LEASE)
    ) and cleared[0]:
        migration = cleared[1]
    assert await texts_of(knowledge, ns, 1, dim=4) == set()
    assert await texts_of(knowledge, ns, 0) == before | {"late"}
    base = (await knowledge.get_bases(management(ns), ["kb"]))[0]
    assert (base.embedder, base.generation) == (SOURCE.name, 0)
    assert await migrations.transition(
        created.id, expect=[MigrationState.CANCELLING], state=MigrationState.CANCELLED
    )
    again = await migrations.create(planned(ns, "kb"))
    assert again is not None, "a finished migration no longer holds the base"
    assert again.rows_total == 3
    # The new migration starts with nothing done (the cancelled one's progress is gone).
    fresh = await claim(migrations, runner, again.id)
    assert {d.ref for d in await migrations.pending_documents(fresh, limit=10)} == {"doc-0", "doc-1", "late"}


async def test_deleting_the_base_ends_its_migration_and_other_bases_are_untouched(backend: Backend) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    await create_base(knowledge, ns, "other")
    body = "other text"
    await knowledge.replace_document(
        management(ns),
        kb_ref="other",
        ref="doc-0",
        content_type="text/plain",
        content_sha256=sha(body),
        size_bytes=len(body),
        metadata={},
        chunks=chunk_rows([body]),
        text=body,
    )
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    runner = "runner-kb-f"
    migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
    other = await knowledge.search(
        launcher(ns, "other"),
        ["other"],
        lambda _rows: vector_query(axis(0), k=10),
        row_count=10,
        count_cap=1,
        filter_=None,
        generations=[1],
    )
    assert other.candidates == [], "the migration wrote its own base's documents only"
    assert await knowledge.delete_base(management(ns), "kb") == 1
    assert not await migrations.cut_over(migration, runner)
    ended = await migrations.get(created.id)
    assert ended is not None
    assert (ended.state, ended.reason) == (MigrationState.CANCELLED, "the knowledge base was deleted")
    assert await migrations.store_documents(migration, runner, [], lease_seconds=LEASE) is None


async def test_a_stale_document_version_is_not_written_and_stays_pending(backend: Backend) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    runner = "runner-kb-g"
    migration = await claim(migrations, runner, created.id)
    read = await migrations.pending_documents(migration, limit=10)
    await upload_text(knowledge, ns, "doc-0", ["doc 0 v2"])
    stored = await migrations.store_documents(migration, runner, embedded(read), lease_seconds=LEASE)
    assert stored is not None
    assert stored.rows_done == 0
    assert (
        await migrations.store_documents(migration, "someone-else", embedded(read), lease_seconds=LEASE)
        is None
    )
    again = await migrations.pending_documents(replace_cursor(stored), limit=10)
    assert [(d.ref, d.version) for d in again] == [("doc-0", 2)]
    assert not await migrations.cut_over(stored, runner)


async def test_the_base_size_counts_documents_chunks_and_documents_without_text(backend: Backend) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=2)
    await upload(knowledge, ns, "kb", "textless", ["x" * 10])  # as uploaded before texts were kept
    documents, chunks, average, without_text = await migrations.base_size(ns, "kb")
    assert (documents, chunks, without_text) == (3, 7, 1)
    assert average == round((6 * len("doc 0 part 0") + 10) / 7)


async def test_a_document_deleted_and_uploaded_again_is_not_written_from_its_old_content(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns, _ = await base_with(knowledge, documents=1)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    runner = "runner-kb-h"
    migration = await claim(migrations, runner, created.id)
    read = await migrations.pending_documents(migration, limit=10)
    # Deleted and uploaded again: version 1 again, other content, written by a replica that
    # did not know of the migration.
    assert await knowledge.delete_document(management(ns), "kb", "doc-0") == 3
    await upload_text(knowledge, ns, "doc-0", ["brand new text"])
    stored = await migrations.store_documents(migration, runner, embedded(read), lease_seconds=LEASE)
    assert stored is not None
    assert stored.rows_done == 0, "the old content's chunks are not written for the new document"
    (again,) = await migrations.pending_documents(replace_cursor(stored), limit=10)
    assert (again.ref, again.version, [c.text for c in again.chunks]) == ("doc-0", 1, ["brand new text"])
    migration = await backfill(migrations, replace_cursor(stored), runner)
    assert await migrations.cut_over(migration, runner)
    assert await texts_of(knowledge, ns, 1, dim=4) == {"brand new text"}


async def test_a_migration_reads_each_chunks_location_and_the_documents_spans_and_keeps_them(
    backend: Backend,
) -> None:
    knowledge, migrations = backend.knowledge, backend.migrations
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    texts = ["slide one", "slide two"]
    spans = (SourceSpan(0, 9, slide=1), SourceSpan(10, 19, slide=2))
    located = [
        replace(chunk, location=Location(first_slide=i + 1, last_slide=i + 1))
        for i, chunk in enumerate(chunk_rows(texts))
    ]
    await upload_text(knowledge, ns, "deck.pptx", texts, chunks=located, source_spans=spans)
    created = await migrations.create(planned(ns, "kb"))
    assert created is not None
    runner = "runner-kb-loc"
    migration = await claim(migrations, runner, created.id)
    (document,) = await migrations.pending_documents(migration, limit=10)
    assert document.spans == spans, "what a re-chunking locates its new chunks against"
    assert [c.location for c in document.chunks] == [c.location for c in located]
    stored = await backfill(migrations, migration, runner)
    assert await migrations.cut_over(stored, runner)
    outcome = await knowledge.search(
        launcher(ns, "kb"),
        ["kb"],
        lambda _rows: vector_query(axis(0, 4), k=10),
        row_count=10,
        count_cap=1,
        filter_=None,
        generations=[1],
    )
    assert {c.item.text: c.item.location.first_slide for c in outcome.candidates} == {
        "slide one": 1,
        "slide two": 2,
    }
