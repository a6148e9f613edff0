"""Assembles an extracted text from its parts and records each part's `SourceSpan` on the way.

The formats with pages, slides or rows use it so that a span's offsets are exactly those of its
part in the final text (code points, end exclusive). `markdown_line` escapes a text line that the
markdown chunker would otherwise read as a heading or a code fence (the formats that render light
Markdown put their own headings in and must keep the document's lines from becoming some).
"""

from __future__ import annotations

import re

from tokensvc.knowledge.formats.documents import ExtractedDocument, SourceSpan

__all__ = ["TextBuilder", "markdown_line"]

# Lines the markdown chunker would read as a heading or a code fence.
_MARKDOWN_SYNTAX = re.compile(r"[ \t]*(?:#{1,6}(?:\s|$)|```|~~~)")


def markdown_line(line: str) -> str:
    """`line`, with a backslash in front when Markdown would read it as a heading or a fence."""
    return "\\" + line if _MARKDOWN_SYNTAX.match(line) else line


class TextBuilder:
    """Collects parts, separated as asked, into one text with the source spans of those parts."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._length = 0
        self._spans: list[SourceSpan] = []

    @property
    def empty(self) -> bool:
        return not self._parts

    def add(
        self,
        text: str,
        separator: str = "\n\n",
        *,
        page: int = 0,
        slide: int = 0,
        sheet: str = "",
        row: int = 0,
    ) -> None:
        """Append `text` (after `separator` unless it is the first part). It gets a span when it
        says where it came from (a page, slide, sheet or row)."""
        if self._parts:
            self._parts.append(separator)
            self._length += len(separator)
        start = self._length
        self._parts.append(text)
        self._length += len(text)
        if page or slide or sheet or row:
            self._spans.append(SourceSpan(start, self._length, page, slide, sheet, row))

    def document(self, media_type: str) -> ExtractedDocument:
        return ExtractedDocument("".join(self._parts), media_type, tuple(self._spans))
