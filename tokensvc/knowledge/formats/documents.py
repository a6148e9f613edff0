"""What extraction yields: a document's text, and where each part of it was in the original.

Passage offsets index the extracted text (see `Passage` in `protos/tokensvc/v1/knowledge.proto`),
so what it is matters to clients; each format's module says what its text is. Formats with pages,
slides or rows also say where each span of that text came from (`SourceSpan`), so a passage can be
cited to its page, slide or rows (`locate`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from tokensvc.storage.records import NOWHERE, Location, SourceSpan

__all__ = ["ExtractedDocument", "ExtractionLimits", "Location", "SourceSpan", "SpanIndex"]


@dataclass(frozen=True)
class ExtractionLimits:
    """Bounds on what one document may make a worker parse (settings `knowledge_extract_*`)."""

    max_pages: int = 5_000
    max_slides: int = 2_000
    max_sheets: int = 100
    max_rows: int = 1_000_000  # of all sheets together
    max_cells: int = 10_000_000
    # Zip-based formats (DOCX, PPTX, XLSX), checked from the archive's directory before parsing.
    max_uncompressed_bytes: int = 512 * 1024 * 1024
    max_archive_entries: int = 10_000
    max_compression_ratio: float = 200.0
    max_nesting: int = 200  # JSON


@dataclass(frozen=True)
class ExtractedDocument:
    """A document's extracted text, its source spans in text order (none for formats without
    pages, slides or rows), and its media type (resolved from the bytes for
    `application/octet-stream`)."""

    text: str
    media_type: str
    spans: tuple[SourceSpan, ...] = ()


class SpanIndex:
    """Locates passages among a document's source spans (in text order)."""

    def __init__(self, spans: tuple[SourceSpan, ...]):
        self._spans = spans
        self._ends = [span.end for span in spans]

    def locate(self, start: int, end: int) -> Location:
        """The location of the text from `start` to `end` (exclusive): that of the spans it
        overlaps. Rows are those of the first sheet it overlaps (a passage across sheets names the
        first)."""
        touched = []
        for span in self._spans[bisect_right(self._ends, start) :]:
            if span.start >= end:
                break
            touched.append(span)
        if not touched or end <= start:
            return NOWHERE
        pages = [span.page for span in touched if span.page]
        slides = [span.slide for span in touched if span.slide]
        sheet = touched[0].sheet
        rows = [span.row for span in touched if span.row and span.sheet == sheet]
        return Location(
            first_page=min(pages, default=0),
            last_page=max(pages, default=0),
            first_slide=min(slides, default=0),
            last_slide=max(slides, default=0),
            sheet=sheet,
            first_row=min(rows, default=0),
            last_row=max(rows, default=0),
        )
