"""XLSX, CSV, JSON, JSON Lines and source code: rows become records under their header, each cited
to its sheet and row (or line); and how a type is found: from a file name, or from the bytes of an
`application/octet-stream` upload."""

from __future__ import annotations

import datetime

import pytest
from openpyxl.workbook import Workbook

from tests.knowledge.document_support import DOCX, PPTX, XLSX, document, made_xlsx
from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import (
    ExtractionLimits,
    SourceSpan,
    SpanIndex,
    extract_document,
    media_type_for_filename,
    parse_content_type,
)

# --- XLSX ----------------------------------------------------------------------------------------


def spans_of(text: str, spans: tuple[SourceSpan, ...], needle: str) -> list[SourceSpan]:
    return [s for s in spans if needle in text[s.start : s.end]]


def test_each_sheet_is_a_section_and_each_row_a_record_with_its_header() -> None:
    extracted = extract_document(document("iso-codes.xlsx"), XLSX)
    text = extracted.text
    headings = [line for line in text.splitlines() if line.startswith("# ")]
    assert headings == ["# Countries", "# Languages", "# Currencies", "# Scripts", "# Notes"]
    (afghanistan,) = spans_of(text, extracted.spans, "name: Afghanistan;")
    assert (afghanistan.sheet, afghanistan.row) == ("Countries", 4)
    record = text[afghanistan.start : afghanistan.end]
    assert record.startswith("alpha_2: AF; alpha_3: AFG; numeric: 4; name: Afghanistan;")
    # The merged title above the header is a line of its own, not the header.
    title = text[extracted.spans[1].start : extracted.spans[1].end]
    assert (title, extracted.spans[1].row) == ("ISO 3166-1 countries (iso-codes 4.15.0)", 1)
    (euro,) = spans_of(text, extracted.spans, "alpha_3: EUR;")
    assert euro.sheet == "Currencies"
    notes = text[text.index("# Notes") :]
    assert notes == "# Notes\n\nGenerated: Empty cells, then a value far right\nH: 42"


def test_a_passage_of_rows_is_cited_to_its_sheet_and_row_range() -> None:
    extracted = extract_document(document("iso-codes.xlsx"), XLSX)
    index = SpanIndex(extracted.spans)
    chunks = chunk_document(extracted.text, ChunkingStrategy(ChunkingKind.MARKDOWN, 64, 0))
    for chunk in chunks:
        where = index.locate(chunk.start, chunk.end)
        assert where.sheet == chunk.heading_path[0]
        assert 0 < where.first_row <= where.last_row
        assert extracted.text[chunk.start : chunk.end] == chunk.text


def _awkward(book: Workbook) -> None:
    sheet = book.active
    assert sheet is not None
    sheet.title = "Rota"
    sheet.append(["Name", None, "Shift\nstart"])
    sheet.append([])
    sheet.append(["Ada", "ops", datetime.datetime(2026, 12, 5, 14, 30), "extra"])
    sheet.append(["# Bob", None, datetime.datetime(2026, 12, 6), None])
    sheet.append([None, True, 2.0, 0.25])
    book.create_sheet("Empty")


def test_spreadsheet_cells_render_as_records_without_losing_a_value() -> None:
    extracted = extract_document(made_xlsx(_awkward), XLSX)
    assert extracted.text == (
        "# Rota\n\n"
        "Name: Ada; B: ops; Shift start: 2026-12-05 14:30:00; D: extra\n"
        "Name: # Bob; Shift start: 2026-12-06\n"
        "B: TRUE; Shift start: 2; D: 0.25"
    )
    assert [(s.sheet, s.row) for s in extracted.spans] == [("Rota", 0), ("Rota", 3), ("Rota", 4), ("Rota", 5)]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (ExtractionLimits(max_sheets=4), "5 sheets, more than the limit of 4"),
        (ExtractionLimits(max_rows=1000), "rows, more than the limit of 1,000"),
        (ExtractionLimits(max_cells=5000), "cells, more than the limit of 5,000"),
    ],
)
def test_a_workbook_past_a_limit_is_too_large(limits: ExtractionLimits, message: str) -> None:
    with pytest.raises(PayloadTooLarge) as refused:
        extract_document(document("iso-codes.xlsx"), XLSX, limits)
    assert refused.value.field == "content"
    assert message in refused.value.message


def test_a_sheet_declaring_fewer_rows_than_it_holds_is_read_whole() -> None:
    """openpyxl's read-only reader stops at a sheet's declared dimension unless it is reset."""

    def lying(book: Workbook) -> None:
        sheet = book.active
        assert sheet is not None
        for number in range(1, 301):
            sheet.append([f"id{number}", number])

    content = made_xlsx(lying)
    content = content.replace(b'<dimension ref="A1:B300"/>', b'<dimension ref="A1:B3"/>')
    extracted = extract_document(content, XLSX)
    assert extracted.spans[-1].row == 300
    assert "id1: id300; 1: 300" in extracted.text


# --- CSV -----------------------------------------------------------------------------------------


def test_csv_rows_are_records_numbered_as_in_the_file() -> None:
    content = '\ufeffname;team;note\r\nada;ops;"two\r\nlines"\r\n\r\nbob;;x\r\n'.encode()
    extracted = extract_document(content, "text/csv; charset=utf-8")
    assert extracted.text == "name: ada; team: ops; note: two lines\nname: bob; note: x"
    assert [(s.sheet, s.row) for s in extracted.spans] == [("", 2), ("", 4)]


@pytest.mark.parametrize("delimiter", [",", "\t", "|", ";"])
def test_the_csv_delimiter_is_sniffed(delimiter: str) -> None:
    content = delimiter.join(["package", "version"]) + "\n" + delimiter.join(["0ad", "0.0.26-3"]) + "\n"
    assert extract_document(content.encode(), "text/csv").text == "package: 0ad; version: 0.0.26-3"


def test_a_csv_past_the_row_limit_is_too_large() -> None:
    content = b"n\n" + b"".join(b"%d\n" % n for n in range(100))
    with pytest.raises(PayloadTooLarge, match="more than the limit of 50"):
        extract_document(content, "text/csv", ExtractionLimits(max_rows=50))


# --- JSON and JSON Lines ---------------------------------------------------------------------------


def test_json_is_rendered_indented_and_validated() -> None:
    content = b'{"team": "ops", "members": [{"name": "Zo\\u00eb"}], "on_call": true}'
    assert extract_document(content, "application/json").text == (
        '{\n  "team": "ops",\n  "members": [\n    {\n      "name": "Zoë"\n    }\n  ],\n  "on_call": true\n}'
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"a": [1, 2}', "is not valid JSON: Expecting ',' delimiter: line 1 column 12"),
        (b'{"a": NaN}', "is not valid JSON: NaN is not JSON"),
        (b'["\\ud800"]', "U+D800, which cannot be stored"),
        (b"[" * 300 + b"]" * 300, "is nested deeper than 200 levels"),
        (b"[" * 200_000, "is nested deeper than 200 levels"),
    ],
)
def test_bad_json_is_refused_saying_why(content: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        extract_document(content, "application/json")
    assert refused.value.field == "content"
    assert message in refused.value.message


def test_json_control_characters_stay_escaped() -> None:
    assert extract_document(b'["nul \\u0000 here"]', "application/json").text == '[\n  "nul \\u0000 here"\n]'


def test_json_lines_are_records_cited_by_line_number() -> None:
    extracted = extract_document(document("iso-639-3-first-300.jsonl"), "application/jsonl")
    assert [s.row for s in extracted.spans] == list(range(1, 301))
    first = extracted.text[: extracted.spans[0].end]
    assert first.startswith('{"alpha_3": "aaa", "name": "Ghotuo"')


@pytest.mark.parametrize("media_type", ["application/jsonl", "application/x-ndjson"])
def test_blank_lines_count_and_a_bad_line_is_named(media_type: str) -> None:
    extracted = extract_document(b'{"a": 1}\r\n\n  \n[2,3]\n', media_type)
    assert extracted.media_type == media_type
    assert extracted.text == '{"a": 1}\n[2, 3]'
    assert [s.row for s in extracted.spans] == [1, 4]
    with pytest.raises(InvalidArgument, match="line 3 is not valid JSON"):
        extract_document(b"{}\n[]\n{oops}\n", media_type)


# --- source code, content types and file names ---------------------------------------------------------


@pytest.mark.parametrize("media_type", ["text/x-python", "text/javascript", "application/yaml", "text/x-c++"])
def test_source_code_is_kept_verbatim(media_type: str) -> None:
    code = "# comment\r\ndef f():\n\treturn 'ü'  \n"
    extracted = extract_document(code.encode(), f"{media_type}; charset=utf-8")
    assert (extracted.text, extracted.media_type, extracted.spans) == (code, media_type, ())


def test_binary_types_ignore_a_charset_and_text_types_refuse_other_charsets() -> None:
    assert parse_content_type("application/pdf; charset=latin-1") == "application/pdf"
    with pytest.raises(InvalidArgument, match="charset must be utf-8"):
        parse_content_type("text/csv; charset=latin-1")


@pytest.mark.parametrize(
    ("name", "media_type"),
    [
        ("r-intro.pdf", "application/pdf"),
        ("Report.DOCX", DOCX),
        ("deck.pptx", PPTX),
        ("dir/book.xlsx", XLSX),
        ("rows.csv", "text/csv"),
        ("a.json", "application/json"),
        ("a.jsonl", "application/jsonl"),
        ("a.ndjson", "application/x-ndjson"),
        ("README.md", "text/markdown"),
        ("page.htm", "text/html"),
        ("notes.txt", "text/plain"),
        ("main.py", "text/x-python"),
        ("lib.rs", "text/x-rust"),
        ("app.tsx", "text/x-typescript"),
        ("C:\\src\\x.hpp", "text/x-c++"),
        ("deploy.yml", "application/yaml"),
        ("pyproject.toml", "application/toml"),
        ("run.sh", "text/x-shellscript"),
        ("archive.zip", None),
        (".bashrc", None),
        ("Makefile", None),
    ],
)
def test_the_media_type_is_inferred_from_a_file_name(name: str, media_type: str | None) -> None:
    assert media_type_for_filename(name) == media_type


@pytest.mark.parametrize(
    ("name", "media_type"),
    [
        ("r-intro.pdf", "application/pdf"),
        ("git-manual.docx", DOCX),
        ("git-manual-slides.pptx", PPTX),
        ("iso-codes.xlsx", XLSX),
    ],
)
def test_an_octet_stream_is_extracted_as_the_type_its_bytes_show(name: str, media_type: str) -> None:
    content = document(name)
    found = extract_document(content, "application/octet-stream")
    assert found == extract_document(content, media_type)
    assert found.media_type == media_type


@pytest.mark.parametrize("content", [b"just some text", b"PK\x03\x04 not really a zip", b"\x89PNG\r\n\x1a\n"])
def test_an_octet_stream_of_no_recognised_type_names_the_content_type(content: bytes) -> None:
    with pytest.raises(InvalidArgument) as refused:
        extract_document(content, "application/octet-stream", field="documents[0].content_type")
    assert refused.value.field == "documents[0].content_type"
    assert "not a PDF, DOCX, PPTX or XLSX file" in refused.value.message
    assert "declare the document's content type" in refused.value.message
