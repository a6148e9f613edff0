"""Document formats: turn an uploaded document's bytes into the text that is chunked and cited.

`extract_document` picks the format by media type (`parse_content_type` checks a declared content
type first, in the server; the bytes themselves are parsed only in the extraction workers). Each
format's module says what its text is: `text` (plain text, Markdown, HTML).

Errors are `InvalidArgument`: an unsupported content type or charset (the `field` given, by default
`header.content_type`); content that cannot be read as its type, or holds no text (field
`content`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.formats.documents import (
    ExtractedDocument,
    ExtractionLimits,
    Location,
    SourceSpan,
    SpanIndex,
)
from tokensvc.knowledge.formats.text import decoded_text, html_text

__all__ = [
    "OCTET_STREAM",
    "SUPPORTED_CONTENT_TYPES",
    "ExtractedDocument",
    "ExtractionLimits",
    "Location",
    "SourceSpan",
    "SpanIndex",
    "extract_document",
    "extract_text",
    "parse_content_type",
]

Extractor = Callable[[bytes, ExtractionLimits], ExtractedDocument]
# Bytes of no declared type: the format is read from their signature, in the worker.
OCTET_STREAM = "application/octet-stream"


def _plain(media_type: str) -> Extractor:
    return lambda content, limits: ExtractedDocument(decoded_text(content), media_type)


def _html(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    return ExtractedDocument(html_text(decoded_text(content)), "text/html")


# Media type -> its extractor. Text types take a `charset` parameter (UTF-8 only).
_EXTRACTORS: dict[str, Extractor] = {
    "text/plain": _plain("text/plain"),
    "text/markdown": _plain("text/markdown"),
    "text/html": _html,
}
SUPPORTED_CONTENT_TYPES = tuple(_EXTRACTORS)
_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_content_type(content_type: str, field: str = "header.content_type") -> str:
    """Return the media type (lower case) of a supported content type, checking its parameters."""
    media_type, *parameters = content_type.split(";")
    media_type = media_type.strip().lower()
    if media_type not in _EXTRACTORS:
        shown = media_type[:80] or "(empty)"
        raise InvalidArgument(field, f"must be one of {', '.join(SUPPORTED_CONTENT_TYPES)}, got {shown!r}")
    for parameter in parameters:
        name, equals, value = parameter.partition("=")
        name, value = name.strip().lower(), value.strip().strip('"').lower()
        if not equals or not _TOKEN.fullmatch(name):
            raise InvalidArgument(field, "has a malformed parameter; expected `name=value`")
        # Other parameters (text/markdown's `variant`, for example) do not change the bytes. A
        # declared `us-ascii` charset is read as UTF-8, its superset.
        if name == "charset" and value not in _CHARSETS:
            raise InvalidArgument(field, f"charset must be utf-8, got {value[:40]!r}")
    return media_type


def extract_document(
    content: bytes,
    content_type: str,
    limits: ExtractionLimits | None = None,
    field: str = "header.content_type",
) -> ExtractedDocument:
    """A document's text and source spans; what each type yields is its module's docstring."""
    media_type = parse_content_type(content_type, field)
    document = _EXTRACTORS[media_type](content, limits or ExtractionLimits())
    if not document.text.strip():
        raise InvalidArgument("content", "has no text")
    return document


def extract_text(content: bytes, content_type: str, field: str = "header.content_type") -> str:
    """The text of a document (`extract_document` without its source spans)."""
    return extract_document(content, content_type, field=field).text
