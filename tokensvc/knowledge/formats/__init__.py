"""Document formats: turn an uploaded document's bytes into the text that is chunked and cited.

`extract_document` picks the format by media type (`parse_content_type` checks a declared content
type first, in the server; the bytes themselves are parsed only in the extraction workers, and
so is `application/octet-stream` resolved to a type by the bytes' signature: `sniffing`). The
supported types and their file extensions are one table (`media_types`). Each format's module
says what its text is: `text` (plain text, Markdown, HTML, and source code, verbatim), `pdf`,
`word` (DOCX), `slides` (PPTX), `spreadsheets` (XLSX), `records` (CSV), `json_documents` (JSON,
JSON Lines). Zip-based formats pass `archives`' decompression-bomb check before any parser.

Errors are `InvalidArgument`: an unsupported content type or charset (the `field` given, by default
`header.content_type`); content that cannot be read as its type, or holds no text (field
`content`). `PayloadTooLarge` (field `content`) when the document passes a bound of
`ExtractionLimits` (pages, slides, sheets, rows, cells, a decompression bomb's sizes). A parser's
own exception never escapes: it becomes "is not a valid <FORMAT> file: ..." (`refusals`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import cast

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.formats.documents import (
    ExtractedDocument,
    ExtractionLimits,
    Location,
    SourceSpan,
    SpanIndex,
)
from tokensvc.knowledge.formats.media_types import (
    CODE_MEDIA_TYPES,
    DOCX,
    MEDIA_TYPES,
    OCTET_STREAM,
    PPTX,
    XLSX,
    media_type_for_filename,
)
from tokensvc.knowledge.formats.sniffing import sniff_media_type
from tokensvc.knowledge.formats.text import decoded_text, html_text

__all__ = [
    "FORMAT_MODULES",
    "OCTET_STREAM",
    "SUPPORTED_CONTENT_TYPES",
    "ExtractedDocument",
    "ExtractionLimits",
    "Location",
    "SourceSpan",
    "SpanIndex",
    "extract_document",
    "extract_text",
    "media_type_for_filename",
    "parse_content_type",
]

Extractor = Callable[[bytes, ExtractionLimits], ExtractedDocument]


def _plain(media_type: str) -> Extractor:
    return lambda content, limits: ExtractedDocument(decoded_text(content), media_type)


def _html(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    return ExtractedDocument(html_text(decoded_text(content)), "text/html")


# Media type -> its extractor (`media_types` lists them with their file extensions; a test
# checks that the two agree). `application/octet-stream` resolves to one of these first. The
# binary and structured formats are named as `module:function` and imported on first use: the
# server's own process checks content types but never parses, and need not load their libraries
# (some 50 MB); the extraction workers' fork server preloads `FORMAT_MODULES`.
_EXTRACTORS: dict[str, Extractor | str] = {
    "text/plain": _plain("text/plain"),
    "text/markdown": _plain("text/markdown"),
    "text/html": _html,
    "application/pdf": "pdf:pdf_document",
    DOCX: "word:docx_document",
    PPTX: "slides:pptx_document",
    XLSX: "spreadsheets:xlsx_document",
    "text/csv": "records:csv_document",
    "application/json": "json_documents:json_document",
    "application/jsonl": "json_documents:json_lines_document",
    "application/x-ndjson": "json_documents:ndjson_document",
    **{media_type: _plain(media_type) for media_type in CODE_MEDIA_TYPES},
}
FORMAT_MODULES = tuple(
    sorted(
        {f"{__name__}.{entry.partition(':')[0]}" for entry in _EXTRACTORS.values() if isinstance(entry, str)}
    )
)
SUPPORTED_CONTENT_TYPES = (*_EXTRACTORS, OCTET_STREAM)
_TEXT_TYPES = frozenset(media.name for media in MEDIA_TYPES if media.text)
# What an unsupported type's refusal lists (the source code types are many: docs/api.md has them).
_LISTED = (
    "text/plain, text/markdown, text/html, application/pdf, DOCX, PPTX, XLSX (their "
    "application/vnd.openxmlformats-officedocument.* types), text/csv, application/json, "
    f"application/jsonl, application/x-ndjson, {OCTET_STREAM}, or a source code type "
    "(text/x-python, text/javascript, application/yaml..., listed in docs/api.md)"
)
_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_content_type(content_type: str, field: str = "header.content_type") -> str:
    """Return the media type (lower case) of a supported content type, checking its parameters."""
    media_type, *parameters = content_type.split(";")
    media_type = media_type.strip().lower()
    if media_type not in SUPPORTED_CONTENT_TYPES:
        shown = media_type[:80] or "(empty)"
        raise InvalidArgument(field, f"must be one of {_LISTED}, got {shown!r}")
    for parameter in parameters:
        name, equals, value = parameter.partition("=")
        name, value = name.strip().lower(), value.strip().strip('"').lower()
        if not equals or not _TOKEN.fullmatch(name):
            raise InvalidArgument(field, "has a malformed parameter; expected `name=value`")
        # Other parameters (text/markdown's `variant`, for example) do not change the bytes. A
        # declared `us-ascii` charset is read as UTF-8, its superset. Binary types have no charset.
        if name == "charset" and value not in _CHARSETS and media_type in _TEXT_TYPES:
            raise InvalidArgument(field, f"charset must be utf-8, got {value[:40]!r}")
    return media_type


def extract_document(
    content: bytes,
    content_type: str,
    limits: ExtractionLimits | None = None,
    field: str = "header.content_type",
) -> ExtractedDocument:
    """A document's text and source spans; what each type yields is its module's docstring.
    `application/octet-stream` is resolved by the bytes' signature (`document.media_type` is
    the type found)."""
    media_type = parse_content_type(content_type, field)
    limits = limits or ExtractionLimits()
    if media_type == OCTET_STREAM:
        media_type = sniff_media_type(content, limits, field)
    document = _extractor(media_type)(content, limits)
    if not document.text.strip():
        raise InvalidArgument("content", "has no text")
    return document


def _extractor(media_type: str) -> Extractor:
    entry = _EXTRACTORS[media_type]
    if isinstance(entry, str):
        module, _, function = entry.partition(":")
        entry = cast(Extractor, getattr(importlib.import_module(f"{__name__}.{module}"), function))
    return entry


def extract_text(content: bytes, content_type: str, field: str = "header.content_type") -> str:
    """The text of a document (`extract_document` without its source spans)."""
    return extract_document(content, content_type, field=field).text
