"""Documents teams have, end to end over gRPC: a PDF, a spreadsheet sent as bare bytes, a Word
file; each searchable, each passage cited to its page, rows or heading, sliceable from the text
GetDocument returns; and the CLI's way of printing where a passage is."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from tests.api.knowledge_support import MARKDOWN, Clients, failure, new_ref, open_clients
from tests.knowledge.document_support import DOCX, XLSX, document
from tests.knowledge.test_hostile_documents import CORPUS
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.cli.knowledge_commands import _where
from tokensvc.errors import PayloadTooLarge
from tokensvc.knowledge.formats import ExtractionLimits
from tokensvc.v1 import common_pb2, knowledge_pb2

TEXT = common_pb2.SEARCH_MODE_TEXT
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
async def clients(service: Service, dev: DevPaths) -> AsyncIterator[Clients]:
    async with open_clients(service, dev) as opened:
        yield opened


async def test_a_pdfs_passages_are_cited_to_their_pages(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    uploaded = await manager.upload(
        kb, "r-intro.pdf", document("r-intro.pdf"), content_type="application/pdf"
    )
    assert (uploaded.document.content_type, uploaded.chunk_count > 100) == ("application/pdf", True)
    (passage,) = await clients.searcher([kb]).search("warm thanks to Bill Venables", [kb], top_k=1, mode=TEXT)
    # The acknowledgements are on page 7 of R-intro (a chunk may reach onto the next page).
    assert passage.location.first_page == 7
    assert passage.location.last_page in (7, 8)
    text = (await manager.get_document(kb, "r-intro.pdf", include_text=True)).text
    assert text[passage.start_offset : passage.end_offset] == passage.text
    assert "Bill Venables" in passage.text


async def test_a_spreadsheet_sent_as_bytes_is_recognised_and_cited_to_its_sheet_and_rows(
    clients: Clients,
) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    uploaded = await manager.upload(
        kb, "iso-codes", document("iso-codes.xlsx"), content_type="application/octet-stream"
    )
    assert uploaded.document.content_type == XLSX  # what its bytes were recognised as
    passages = await clients.searcher([kb]).search("Liechtenstein", [kb], top_k=3, mode=TEXT)
    assert passages
    for passage in passages:
        assert passage.location.sheet
        assert 1 < passage.location.first_row <= passage.location.last_row
        assert "Liechtenstein" in passage.text


async def test_a_word_documents_headings_become_the_passages_heading_path(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    await manager.upload(kb, "git.docx", document("git-manual.docx"), content_type=DOCX)
    passages = await clients.searcher([kb]).search("GIT_DIR environment", [kb], top_k=5, mode=TEXT)
    assert passages
    assert all(p.heading_path for p in passages)
    assert all(not p.HasField("location") for p in passages)  # Word files have no pages to cite


def test_the_cli_prints_where_a_passage_is() -> None:
    location = knowledge_pb2.PassageLocation
    assert _where(location(first_page=3, last_page=3)) == " p. 3"
    assert _where(location(first_page=3, last_page=4)) == " pp. 3-4"
    assert _where(location(first_slide=2, last_slide=2)) == " slide 2"
    assert _where(location(sheet="Q1", first_row=10, last_row=42)) == " Q1 rows 10-42"
    assert _where(location(first_row=7, last_row=7)) == " row 7"


@pytest.mark.slow
async def test_hostile_documents_are_refused_over_grpc_and_store_nothing(clients: Clients) -> None:
    """Every hostile file the server's default limits refuse, sent as an upload: INVALID_ARGUMENT
    (reason INVALID_ARGUMENT or PAYLOAD_TOO_LARGE) on `content` with its reason, no document
    written, and the server keeps serving uploads."""
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    refused = [hostile for hostile in CORPUS if hostile.limits == ExtractionLimits()]
    assert len(refused) > 25
    for hostile in refused:
        failed = await failure(
            manager.upload(kb, hostile.name, hostile.make(), content_type=hostile.content_type)
        )
        reason = "PAYLOAD_TOO_LARGE" if hostile.refusal is PayloadTooLarge else "INVALID_ARGUMENT"
        assert (failed.code, failed.reason, failed.field_violations) == (INVALID, reason, ["content"]), (
            hostile.name
        )
        assert hostile.reason in failed.message, hostile.name
    assert (await manager.get(kb)).document_count == 0
    uploaded = await manager.upload(kb, "git.docx", document("git-manual.docx"), content_type=DOCX)
    assert uploaded.document.version == 1
