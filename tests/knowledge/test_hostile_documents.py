"""Malformed and hostile documents of every type: each is refused as INVALID_ARGUMENT or
PAYLOAD_TOO_LARGE on `content` with a reason that says what is wrong (encrypted, no text layer, a
decompression bomb, too deep, too many pages...), never anything else; and through the real
extraction pool, with its memory cap, none of them takes the server down.

Small hostile files are vendored (fixtures/documents/hostile, MANIFEST.tsv); bombs, truncations
and corruptions are made here from the vendored real files."""

from __future__ import annotations

import asyncio
import functools
import io
import os
import random
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field

import openpyxl
import pytest

from tests.knowledge.document_support import (
    DOCX,
    MIB,
    PPTX,
    XLSX,
    document,
    made_xlsx,
    padded,
    rebuilt,
    understated,
)
from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, ExtractionPool
from tokensvc.knowledge.formats import ExtractionLimits, extract_document

DEFAULT = ExtractionLimits()
BOMB = "(a decompression bomb?)"
NOT_PDF, NOT_DOCX, NOT_PPTX, NOT_XLSX = (
    f"is not a valid {kind} file" for kind in ("PDF", "DOCX", "PPTX", "XLSX")
)


@dataclass(frozen=True)
class Hostile:
    name: str
    make: Callable[[], bytes]
    content_type: str
    refusal: type[InvalidArgument]
    reason: str
    limits: ExtractionLimits = field(default=DEFAULT)


def vendored(name: str) -> Callable[[], bytes]:
    return functools.partial(document, name)


@functools.cache
def r_intro() -> bytes:
    return document("r-intro.pdf")


def garbage_at_a_third() -> bytes:
    data = bytearray(r_intro())
    third = len(data) // 3
    data[third : third + 65536] = random.Random(37).randbytes(65536)
    return bytes(data)


def with_understated_entry_count(archive: bytes) -> bytes:
    """`archive` whose end record claims 17 entries, whatever the directory holds."""
    data = bytearray(archive)
    at = data.rfind(b"PK\x05\x06")
    data[at + 8 : at + 12] = struct.pack("<HH", 17, 17)
    return bytes(data)


def zip_of(**parts: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as made:
        for name, data in parts.items():
            made.writestr(name, data)
    return out.getvalue()


def cell_far_away(row: int, column: int) -> Callable[[], bytes]:
    def build(book: openpyxl.Workbook) -> None:
        sheet = book.active
        assert sheet is not None
        sheet.cell(row=1, column=1, value="header")
        sheet.cell(row=row, column=column, value=1)

    return lambda: made_xlsx(build)


git_docx = vendored("git-manual.docx")
git_pptx = vendored("git-manual-slides.pptx")
iso_xlsx = vendored("iso-codes.xlsx")
CORPUS = [
    # PDF
    Hostile("encrypted", vendored("hostile/encrypted-user-password.pdf"), "application/pdf", InvalidArgument, "is an encrypted PDF"),
    Hostile("scanned", vendored("hostile/scanned-no-text.pdf"), "application/pdf", InvalidArgument, "has no text layer (a scanned PDF?)"),
    Hostile("pdf-truncated-50", lambda: r_intro()[: len(r_intro()) // 2], "application/pdf", InvalidArgument, NOT_PDF),
    Hostile("pdf-truncated-5", lambda: r_intro()[: len(r_intro()) // 20], "application/pdf", InvalidArgument, NOT_PDF),
    Hostile("pdf-garbage", garbage_at_a_third, "application/pdf", InvalidArgument, NOT_PDF + ": page 71 cannot be loaded"),
    Hostile("pdf-header-only", lambda: b"%PDF-1.7\n%%EOF\n", "application/pdf", InvalidArgument, NOT_PDF),
    Hostile("pdf-too-many-pages", r_intro, "application/pdf", PayloadTooLarge, "113 pages, more than the limit of 50", ExtractionLimits(max_pages=50)),
    Hostile("pdf-encrypted-as-octets", vendored("hostile/encrypted-user-password.pdf"), "application/octet-stream", InvalidArgument, "is an encrypted PDF"),
    # DOCX
    Hostile("docx-billion-laughs", vendored("hostile/docx-billion-laughs.docx"), DOCX, InvalidArgument, NOT_DOCX),
    Hostile("docx-body-ratio-bomb", lambda: padded(git_docx(), "word/document.xml", b"<w:body>", 8 * MIB), DOCX, PayloadTooLarge, BOMB),
    Hostile("docx-size-bomb", lambda: padded(git_docx(), "word/document.xml", b"<w:body>", 6 * MIB), DOCX, PayloadTooLarge, "MiB, more than the limit of 4 MiB " + BOMB, ExtractionLimits(max_uncompressed_bytes=4 * MIB, max_compression_ratio=1e9)),
    Hostile("docx-entries-bomb", lambda: rebuilt(git_docx(), extra=10_001), DOCX, PayloadTooLarge, "10,018 archive entries, more than the limit of 10,000 " + BOMB),
    Hostile("docx-entries-bomb-lying-count", lambda: with_understated_entry_count(rebuilt(git_docx(), extra=10_001)), DOCX, PayloadTooLarge, "archive entries, more than the limit of 10,000"),
    Hostile("docx-understated-size", lambda: understated(git_docx(), "word/document.xml", 16 * MIB), DOCX, InvalidArgument, NOT_DOCX),
    Hostile("docx-truncated", lambda: git_docx()[:30_000], DOCX, InvalidArgument, NOT_DOCX + ": it is not a zip archive"),
    Hostile("docx-not-a-zip", lambda: b"plain text, no zip", DOCX, InvalidArgument, NOT_DOCX),
    Hostile("docx-zip-of-something-else", lambda: zip_of(**{"a.txt": b"hello"}), DOCX, InvalidArgument, NOT_DOCX),
    # PPTX
    Hostile("pptx-billion-laughs", vendored("hostile/pptx-billion-laughs.pptx"), PPTX, InvalidArgument, NOT_PPTX),
    Hostile("pptx-slide-ratio-bomb", lambda: padded(git_pptx(), "ppt/slides/slide1.xml", b"<p:spTree>", 8 * MIB), PPTX, PayloadTooLarge, BOMB),
    Hostile("pptx-too-many-slides", git_pptx, PPTX, PayloadTooLarge, "25 slides, more than the limit of 10", ExtractionLimits(max_slides=10)),
    Hostile("pptx-truncated", lambda: git_pptx()[:50_000], PPTX, InvalidArgument, NOT_PPTX),
    # XLSX
    Hostile("xlsx-billion-laughs", vendored("hostile/xlsx-billion-laughs.xlsx"), XLSX, InvalidArgument, NOT_XLSX),
    Hostile("xlsx-rows-ratio-bomb", lambda: padded(iso_xlsx(), "xl/worksheets/sheet1.xml", b"<sheetData>", 8 * MIB), XLSX, PayloadTooLarge, BOMB),
    Hostile("xlsx-last-row-of-the-grid", cell_far_away(1_048_576, 1), XLSX, PayloadTooLarge, "rows, more than the limit of 10,000", ExtractionLimits(max_rows=10_000)),
    Hostile("xlsx-last-column-of-the-grid", cell_far_away(2, 16_384), XLSX, PayloadTooLarge, "cells, more than the limit of 10,000", ExtractionLimits(max_cells=10_000)),
    Hostile("xlsx-too-many-sheets", iso_xlsx, XLSX, PayloadTooLarge, "5 sheets, more than the limit of 2", ExtractionLimits(max_sheets=2)),
    Hostile("xlsx-truncated", lambda: iso_xlsx()[:100_000], XLSX, InvalidArgument, NOT_XLSX),
    Hostile("xlsx-bomb-as-octets", lambda: padded(iso_xlsx(), "xl/worksheets/sheet1.xml", b"<sheetData>", 8 * MIB), "application/octet-stream", PayloadTooLarge, BOMB),
    # CSV, JSON, JSON Lines
    Hostile("csv-latin-1", lambda: "name\nCafé\n".encode("latin-1"), "text/csv", InvalidArgument, "is not valid UTF-8"),
    Hostile("csv-huge-field", lambda: b'a\n"' + b"x" * 200_000 + b'"\n', "text/csv", InvalidArgument, "is not a valid CSV file: Error: field larger than field limit"),
    Hostile("csv-nul", lambda: b"a,b\n1,\x00\n", "text/csv", InvalidArgument, "U+0000"),
    Hostile("csv-too-many-rows", lambda: b"n\n" * 2_000, "text/csv", PayloadTooLarge, "rows, more than the limit of 1,000", ExtractionLimits(max_rows=1_000)),
    Hostile("json-200k-brackets", lambda: b"[" * 200_000, "application/json", InvalidArgument, "is nested deeper than 200 levels"),
    Hostile("json-deep", lambda: b'{"a":' * 250 + b"1" + b"}" * 250, "application/json", InvalidArgument, "is nested deeper than 200 levels"),
    Hostile("json-truncated", lambda: b'{"a": [1, 2, {"b": "c', "application/json", InvalidArgument, "is not valid JSON"),
    Hostile("json-huge-integer", lambda: b"1" * 5_000, "application/json", InvalidArgument, "is not valid JSON: Exceeds the limit (4300 digits)"),
    Hostile("jsonl-bad-line", lambda: b'{"a": 1}\n{"a": \n', "application/jsonl", InvalidArgument, "line 2 is not valid JSON"),
    Hostile("jsonl-deep-line", lambda: b"[" * 5_000 + b"]" * 5_000, "application/x-ndjson", InvalidArgument, "line 1 is nested deeper than 200 levels"),
    Hostile("jsonl-too-many-lines", lambda: b"{}\n" * 2_000, "application/jsonl", PayloadTooLarge, "rows, more than the limit of 1,000", ExtractionLimits(max_rows=1_000)),
]  # fmt: skip


@pytest.mark.parametrize("hostile", CORPUS, ids=lambda hostile: hostile.name)
def test_a_hostile_document_is_refused_naming_content_and_why(hostile: Hostile) -> None:
    with pytest.raises(InvalidArgument) as refused:
        extract_document(hostile.make(), hostile.content_type, hostile.limits)
    assert type(refused.value) is hostile.refusal
    assert refused.value.field == "content"
    assert hostile.reason in refused.value.message


def test_bytes_of_no_recognisable_type_are_refused_naming_the_content_type() -> None:
    with pytest.raises(InvalidArgument) as refused:
        extract_document(random.Random(7).randbytes(4096), "application/octet-stream")
    assert refused.value.field == "header.content_type"


async def test_no_hostile_document_takes_the_server_or_the_pool_down() -> None:
    """Through the real extraction pool (default limits, as the server runs it) with a worker
    memory cap: every hostile file is refused as invalid or too large, and the pool still serves."""
    pool = ExtractionPool(workers=1, limit_seconds=60, memory_bytes=1024 * MIB)
    strategy = ChunkingStrategy(ChunkingKind.RECURSIVE, 64, 8)
    try:
        for hostile in CORPUS:
            if hostile.limits != DEFAULT:
                continue  # the pool extracts with the defaults
            with pytest.raises(InvalidArgument) as refused:
                await pool.chunks(hostile.make(), hostile.content_type, strategy)
            assert type(refused.value) is hostile.refusal, hostile.name
            assert refused.value.field == "content", hostile.name
            assert hostile.reason in refused.value.message, hostile.name
        chunks = await pool.chunks(document("git-manual.docx"), DOCX, strategy)
        assert any("the stupid content tracker" in chunk.text for chunk in chunks)
        os.kill(os.getpid(), 0)  # and this process, the server's, is alive
    finally:
        await asyncio.to_thread(pool.close)
