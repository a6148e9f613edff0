"""Background ingestion end to end: an upload returns at once with its version PENDING, a runner
makes it searchable (PROCESSING with progress, then READY), the previous version serves meanwhile,
a newer upload replaces one still queued, a deletion cancels it, a refused document ends FAILED
with its reason, and an upload that waits is not lost when its caller's deadline passes.

Real mTLS, real PostgreSQL + pgvector, the default model where the work must take a while. Where a version must stay queued, the
service runs no background runner (`knowledge_ingest_parallel = 0`): only an upload that waits
works on its own version then.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.api.knowledge_support import (
    FIXED,
    HANDBOOK,
    NAMESPACE,
    VECTOR,
    Manager,
    failure,
    new_ref,
    open_clients,
    row_counts,
)
from tests.conftest import ServiceFactory
from tests.support import SharedDatabase, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import knowledge_pb2

PENDING = knowledge_pb2.DOCUMENT_STATE_PENDING
PROCESSING = knowledge_pb2.DOCUMENT_STATE_PROCESSING
READY = knowledge_pb2.DOCUMENT_STATE_READY
FAILED = knowledge_pb2.DOCUMENT_STATE_FAILED
HANDBOOK_TEXT = HANDBOOK.read_text(encoding="utf-8")
MODEL = "multilingual-e5-small"  # the services under test default to the instant `hash` embedder


async def ingestions(database: SharedDatabase, kb_ref: str) -> list[tuple[str, int, str]]:
    """The queued versions of a base: (document, version, state)."""
    async with superuser(database) as conn:
        rows = await conn.fetch(
            "SELECT doc_ref, version, state FROM tokensvc.ingestions WHERE namespace = $1 AND kb_ref = $2 "
            "ORDER BY doc_ref",
            NAMESPACE,
            kb_ref,
        )
    return [tuple(row) for row in rows]


async def settled(
    manager: Manager, kb: str, doc: str, deadline_s: float = 120
) -> list[knowledge_pb2.Document]:
    """Every distinct state the document is seen in until it is READY or FAILED, polled."""
    seen: list[knowledge_pb2.Document] = []
    began = time.monotonic()
    while time.monotonic() - began < deadline_s:
        document = await manager.get_document(kb, doc)
        if not seen or (seen[-1].state, seen[-1].chunks_done) != (document.state, document.chunks_done):
            seen.append(document)
        if document.state in (READY, FAILED):
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"never settled: {seen[-1]}")


async def test_an_upload_returns_pending_and_becomes_searchable_with_progress(
    start_service: ServiceFactory, dev: DevPaths
) -> None:
    # Batches of 4 chunks: the progress moves in steps a poll can see.
    service = await start_service(knowledge_ingest_batch_size=4)
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED, 64, embedder=MODEL)  # the real model: progress to see
        uploaded = await manager.upload(kb, "handbook.md", HANDBOOK_TEXT, wait=False)
        document = uploaded.document
        assert (document.version, document.state, document.searchable_version) == (1, PENDING, 0)
        assert (uploaded.unchanged, uploaded.chunk_count) == (False, 0)
        seen = await settled(manager, kb, "handbook.md")
        final = seen[-1]
        assert (final.state, final.version, final.searchable_version) == (READY, 1, 1)
        assert final.chunks_done == final.chunk_count > 8
        progress = [d.chunks_done for d in seen if d.state == PROCESSING]
        assert progress
        assert progress == sorted(progress)
        assert all(d.chunk_count == final.chunk_count for d in seen[1:])
        passages = await opened.searcher([kb]).search("incident severity levels", [kb], mode=VECTOR)
        assert passages
        assert passages[0].document_version == 1
        listed = (await manager.list_documents(kb, 10))[0]
        assert [(d.ref, d.state, d.chunks_done) for d in listed] == [
            ("handbook.md", READY, final.chunk_count)
        ]


async def test_the_previous_version_serves_until_the_next_is_ready_and_a_newer_upload_replaces_a_queued_one(
    start_service: ServiceFactory, dev: DevPaths, database: SharedDatabase
) -> None:
    service = await start_service(knowledge_ingest_parallel=0)
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        searcher = opened.searcher([kb])
        await manager.create(kb, FIXED, 32)
        first = await manager.upload(
            kb, "doc.txt", "The first version mentions lighthouses.", content_type="text/plain"
        )
        assert (first.document.version, first.document.state) == (1, READY)
        queued = await manager.upload(
            kb, "doc.txt", "The second version mentions submarines.", content_type="text/plain", wait=False
        )
        assert (queued.document.version, queued.document.state, queued.document.searchable_version) == (
            2,
            PENDING,
            1,
        )
        newer = await manager.upload(
            kb, "doc.txt", "The third version mentions volcanoes.", content_type="text/plain", wait=False
        )
        assert (newer.document.version, newer.document.state) == (3, PENDING)
        assert await ingestions(database, kb) == [("doc.txt", 3, "pending")]
        # Nobody ingests here: searches keep reading version 1, the document shows version 3.
        passages = await searcher.search("which version is this", [kb])
        assert [(p.document_version, p.text) for p in passages] == [
            (1, "The first version mentions lighthouses.")
        ]
        shown = await manager.get_document(kb, "doc.txt", include_text=True)
        assert (shown.version, shown.state, shown.searchable_version) == (3, PENDING, 1)
        assert shown.text == "The first version mentions lighthouses."  # the searchable version's
        # The same bytes again, waiting: this upload works on the queued version itself.
        again = await manager.upload(
            kb, "doc.txt", "The third version mentions volcanoes.", content_type="text/plain"
        )
        assert (again.unchanged, again.document.version, again.document.state) == (True, 3, READY)
        passages = await searcher.search("which version is this", [kb])
        assert [(p.document_version, p.text) for p in passages] == [
            (3, "The third version mentions volcanoes.")
        ]
        assert await ingestions(database, kb) == []
        assert await row_counts(database, kb) == (1, 1, 1)


async def test_uploading_the_searchable_content_again_drops_a_queued_version(
    start_service: ServiceFactory, dev: DevPaths, database: SharedDatabase
) -> None:
    service = await start_service(knowledge_ingest_parallel=0)
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED, 32)
        await manager.upload(kb, "doc.txt", "Version one.", content_type="text/plain")
        await manager.upload(kb, "doc.txt", "Version two.", content_type="text/plain", wait=False)
        back = await manager.upload(kb, "doc.txt", "Version one.", content_type="text/plain", wait=False)
        assert (back.unchanged, back.document.version, back.document.state) == (True, 1, READY)
        assert await ingestions(database, kb) == []


async def test_deleting_a_document_or_its_base_cancels_its_ingestion(
    start_service: ServiceFactory, dev: DevPaths, database: SharedDatabase
) -> None:
    service = await start_service(knowledge_ingest_parallel=0)
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED, 32)
        await manager.upload(kb, "queued.txt", "Never searchable.", content_type="text/plain", wait=False)
        await manager.upload(
            kb, "other.txt", "Never searchable either.", content_type="text/plain", wait=False
        )
        listed = (await manager.list_documents(kb, 10))[0]
        assert [(d.ref, d.state, d.searchable_version) for d in listed] == [
            ("other.txt", PENDING, 0),
            ("queued.txt", PENDING, 0),
        ]
        assert await manager.delete_document(kb, "queued.txt") == 0  # no chunk was searchable
        failed = await failure(manager.get_document(kb, "queued.txt"))
        assert failed.code == grpc.StatusCode.NOT_FOUND
        assert await ingestions(database, kb) == [("other.txt", 1, "pending")]
        assert await manager.delete(kb) == 1
        assert await ingestions(database, kb) == []
        async with superuser(database) as conn:
            left = await conn.fetchval(
                "SELECT (SELECT count(*) FROM tokensvc.ingestion_content WHERE kb_ref = $1) "
                "+ (SELECT count(*) FROM tokensvc.ingestion_chunks WHERE kb_ref = $1)",
                kb,
            )
        assert left == 0


async def test_a_refused_document_ends_failed_with_its_reason_and_the_previous_version_serves(
    start_service: ServiceFactory, dev: DevPaths
) -> None:
    service = await start_service()
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED, 32)
        await manager.upload(kb, "report", "A searchable plain text report.", content_type="text/plain")
        broken = await manager.upload(
            kb, "report", b"%PDF-1.7 truncated", content_type="application/pdf", wait=False
        )
        assert (broken.document.version, broken.document.state) == (2, PENDING)
        final = (await settled(manager, kb, "report"))[-1]
        assert (final.state, final.version, final.searchable_version) == (FAILED, 2, 1)
        assert "could not be" in final.failure_reason or "PDF" in final.failure_reason
        passages = await opened.searcher([kb]).search("report", [kb])
        assert [p.document_version for p in passages] == [1]
        listed = (await manager.list_documents(kb, 10))[0]
        assert [(d.state, d.failure_reason) for d in listed] == [(FAILED, final.failure_reason)]
        # The same bytes again are a new attempt, refused again; a waiting upload says why.
        refused = await failure(
            manager.upload(kb, "report", b"%PDF-1.7 truncated", content_type="application/pdf")
        )
        assert (refused.code, refused.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, ["content"])
        # Nothing of the refused uploads was kept: the next version is the one after version 1.
        fixed = await manager.upload(
            kb, "report", "The corrected report.", content_type="text/plain", wait=False
        )
        assert fixed.document.version == 2
        final = (await settled(manager, kb, "report"))[-1]
        assert (final.state, final.searchable_version) == (READY, 2)


async def test_an_upload_whose_deadline_passes_is_ingested_all_the_same(
    start_service: ServiceFactory, dev: DevPaths, database: SharedDatabase
) -> None:
    """The caller stops waiting; the version is stored, and this replica finishes it anyway
    (issue 37: a deadline no longer loses the work)."""
    service = await start_service(knowledge_ingest_parallel=0)  # the upload's own task, no runner
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED, 32, embedder=MODEL)  # seconds of work, not 0.5
        failed = await failure(manager.upload(kb, "handbook.md", HANDBOOK_TEXT, deadline=0.5))
        assert failed.code == grpc.StatusCode.DEADLINE_EXCEEDED
        final = (await settled(manager, kb, "handbook.md"))[-1]
        assert (final.state, final.version) == (READY, 1)
        assert final.chunks_done == final.chunk_count > 10
        assert (await row_counts(database, kb))[1:] == (1, final.chunk_count)
