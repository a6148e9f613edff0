"""PPTX (`application/vnd.openxmlformats-officedocument.presentationml.presentation`) as light
Markdown, one section a slide, read with python-pptx after the archive check (`archives`).

The extracted text is the slides' sections in slide order, separated by a blank line (`\\n\\n`).
A slide's section is one `SourceSpan(slide=n)` (n counting from 1 in the deck's order) made of
blocks separated by a blank line:

- its heading: `# ` and the slide title's text (whitespace collapsed), or `# Slide n` when the
  slide has no title; so the markdown chunker keeps each slide's passages under its title;
- then each other shape with text, in the slide's shape order, groups entered: a text frame's
  paragraphs and line breaks as lines; a table one line a row, cells joined by ` | `;
- then its speaker notes, when it has any: `Notes: ` and the notes' text.

Lines of the slide's own text that Markdown would read as a heading or a code fence get a
backslash in front; blank lines are dropped. Pictures, charts and media add nothing. Refused: more
slides than `ExtractionLimits.max_slides` (`PayloadTooLarge`), and see `archives` (bombs) and
`refusals` ("is not a valid PPTX file").
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pptx
from pptx.shapes.base import BaseShape
from pptx.shapes.group import GroupShape
from pptx.slide import Slide

from tokensvc.knowledge.formats.archives import check_archive
from tokensvc.knowledge.formats.builder import TextBuilder, markdown_line
from tokensvc.knowledge.formats.documents import ExtractedDocument, ExtractionLimits
from tokensvc.knowledge.formats.media_types import PPTX
from tokensvc.knowledge.formats.refusals import over_limit, unreadable_as

__all__ = ["pptx_document"]


def pptx_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """The slides' text of the PPTX `content` (see the module docstring)."""
    check_archive(content, limits, "PPTX")
    builder = TextBuilder()
    with unreadable_as("PPTX"):
        slides = pptx.Presentation(io.BytesIO(content)).slides
        if len(slides) > limits.max_slides:
            raise over_limit(f"{len(slides):,}", "slides", limits.max_slides)
        for number, slide in enumerate(slides, 1):
            builder.add("\n\n".join(_section(slide, number)), slide=number)
    return builder.document(PPTX)


def _section(slide: Slide, number: int) -> Iterator[str]:
    title = slide.shapes.title
    heading = " ".join(title.text_frame.text.split()) if title is not None and title.has_text_frame else ""
    yield f"# {heading or f'Slide {number}'}"
    title_id = title.shape_id if title is not None else None
    for shape in _shapes(slide):
        if shape.shape_id != title_id:
            block = _shape_text(shape)
            if block:
                yield block
    if slide.has_notes_slide:  # reading notes_slide otherwise would create one
        notes = slide.notes_slide.notes_text_frame
        text = _lines(notes.text) if notes is not None else ""
        if text:
            yield "Notes: " + text


def _shapes(slide: Slide) -> Iterator[BaseShape]:
    """The slide's shapes in order, the shapes of groups (at any depth) in place of the group."""
    stack: list[BaseShape] = list(reversed(list(slide.shapes)))
    while stack:
        shape = stack.pop()
        if isinstance(shape, GroupShape):
            stack.extend(reversed(list(shape.shapes)))
        else:
            yield shape


def _shape_text(shape: BaseShape) -> str:
    if shape.has_text_frame:
        return _lines(shape.text_frame.text)  # type: ignore[attr-defined]
    if shape.has_table:
        rows = (
            " | ".join(" ".join(cell.text.split()) for cell in row.cells)
            for row in shape.table.rows  # type: ignore[attr-defined]
        )
        return "\n".join(markdown_line(row) for row in rows if row.replace("|", "").strip())
    return ""


def _lines(text: str) -> str:
    """A text frame's text: paragraphs (`\\n`) and line breaks (`\\v`) as lines, blank ones dropped."""
    lines = text.replace("\v", "\n").replace("\r", "\n").split("\n")
    return "\n".join(markdown_line(line.rstrip()) for line in lines if line.strip())
