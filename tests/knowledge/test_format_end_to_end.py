"""Every supported type end to end, as an upload goes: extracted, then chunked with each strategy;
each chunk slices out of the text exactly by its offsets, and each span-carrying format cites
every chunk somewhere. And the one table of types agrees with the extractors and the API docs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.knowledge.document_support import DOCX, PPTX, XLSX, document
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import SUPPORTED_CONTENT_TYPES, SpanIndex, extract_document
from tokensvc.knowledge.formats.media_types import MEDIA_TYPES

ROOT = Path(__file__).resolve().parents[2]
API_DOC = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
STRATEGIES = [
    ChunkingStrategy(ChunkingKind.MARKDOWN, 64, 8),
    ChunkingStrategy(ChunkingKind.RECURSIVE, 64, 8),
    ChunkingStrategy(ChunkingKind.FIXED, 32, 4),
]
CSV = b'team;name;note\nops;ada;pages the on-call\n\nops;bob;"two\nlines"\n'
UPLOADS = [
    ("r-intro.pdf", "application/pdf", True),
    ("live-manual-landscape-en.pdf", "application/octet-stream", True),
    ("git-manual.docx", DOCX, False),
    ("tar-manual-fake-headings.docx", DOCX, False),
    ("git-manual-slides.pptx", PPTX, True),
    ("iso-codes.xlsx", XLSX, True),
    ("iso-639-3-first-300.jsonl", "application/jsonl", True),
    (CSV, "text/csv", True),
    (b'{"a": {"b": [1, "two", null]}, "c": "\\u00fcber"}', "application/json", False),
    (b"def f():\r\n    # not a heading\r\n    return 1\n", "text/x-python", False),
]


@pytest.mark.parametrize(("upload", "content_type", "cited"), UPLOADS, ids=lambda value: str(value)[:30])
def test_every_type_chunks_with_exact_offsets_and_citations(
    upload: str | bytes, content_type: str, cited: bool
) -> None:
    content = document(upload) if isinstance(upload, str) else upload
    extracted = extract_document(content, content_type)
    text, index = extracted.text, SpanIndex(extracted.spans)
    assert all(0 <= span.start < span.end <= len(text) for span in extracted.spans)
    assert [span.start for span in extracted.spans] == sorted(span.start for span in extracted.spans)
    for strategy in STRATEGIES:
        chunks = chunk_document(text, strategy)
        assert chunks
        for chunk in chunks:
            assert text[chunk.start : chunk.end] == chunk.text
            assert index.locate(chunk.start, chunk.end).empty is not cited


def test_the_table_of_types_is_the_registry_and_the_api_docs_list_every_type() -> None:
    assert {media.name for media in MEDIA_TYPES} == set(SUPPORTED_CONTENT_TYPES)
    undocumented = [name for name in SUPPORTED_CONTENT_TYPES if f"`{name}`" not in API_DOC]
    assert not undocumented, f"docs/api.md does not list {undocumented}"
    extensions = [extension for media in MEDIA_TYPES for extension in media.extensions]
    assert len(extensions) == len(set(extensions))


def test_the_servers_process_does_not_load_the_parsing_libraries() -> None:
    """Content types are checked in the server's process; the parsers load only in the workers
    (which preload `FORMAT_MODULES`)."""
    script = (
        "import sys, tokensvc.knowledge.formats as formats\n"
        "formats.parse_content_type('application/pdf')\n"
        "print(sorted(m for m in ('pypdfium2', 'docx', 'pptx', 'openpyxl') if m in sys.modules))\n"
        "for name in formats.FORMAT_MODULES: __import__(name)\n"
        "print(sorted(m for m in ('pypdfium2', 'docx', 'pptx', 'openpyxl') if m in sys.modules))\n"
        "import openpyxl.xml; print(openpyxl.xml.DEFUSEDXML)\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert ran.stdout.splitlines() == ["[]", "['docx', 'openpyxl', 'pptx', 'pypdfium2']", "True"]
