"""`application/pdf`: the text layer of each page, read with pypdfium2 (PDFium), pages kept.

The extracted text is the pages' texts in page order, joined by a blank line (`\\n\\n`); each
page's text is one `SourceSpan(page=n)`, n counting from 1 in the file's page order. A page's text
is PDFium's text of the page, normalised:

- line breaks are `\\n` (PDFium gives `\\r\\n`); trailing spaces and tabs end no line; leading
  and trailing blank lines are dropped, and a run of blank lines becomes one;
- a word that PDFium marks as hyphenated at a line end (`gram\\ufffemar`) is joined (`grammar`);
- C0 control characters other than tab and line feed (symbol fonts emit them), U+0000 included,
  are removed.

Nothing else changes (no Markdown escaping: a PDF's text is not read as Markdown by design, but a
knowledge base with the markdown strategy will see a line like `# note` as a heading).

A page without text (a scanned page, a drawing) adds nothing and has no span; a PDF none of whose
pages has text is refused ("has no text layer"). Also refused, as `InvalidArgument` on `content`:
a PDF that needs a password to open ("is an encrypted PDF"; one with only an owner password opens
and is read), one PDFium cannot open or one of whose pages it cannot load ("is not a valid PDF
file"), and, as `PayloadTooLarge`, one with more pages than `ExtractionLimits.max_pages`.
"""

from __future__ import annotations

import re

import pypdfium2
import pypdfium2.raw as pdfium_c

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.formats.builder import TextBuilder
from tokensvc.knowledge.formats.documents import ExtractedDocument, ExtractionLimits
from tokensvc.knowledge.formats.refusals import not_valid, over_limit, unreadable_as

__all__ = ["pdf_document"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\ufffe]")
_TRAILING_SPACE = re.compile(r"[ \t]+(?=\n|$)")
_BLANK_RUN = re.compile(r"\n{3,}")


def pdf_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """The pages' text of the PDF `content` (see the module docstring)."""
    document = _open(content)
    try:
        pages = len(document)
        if pages > limits.max_pages:
            raise over_limit(f"{pages:,}", "pages", limits.max_pages)
        builder = TextBuilder()
        for number in range(1, pages + 1):
            text = _page_text(document, number)
            if text:
                builder.add(text, page=number)
    finally:
        document.close()
    if builder.empty:
        reason = "has no pages" if not pages else "has no text layer (a scanned PDF?); run OCR first"
        raise InvalidArgument("content", reason)
    return builder.document("application/pdf")


def _open(content: bytes) -> pypdfium2.PdfDocument:
    with unreadable_as("PDF"):
        try:
            return pypdfium2.PdfDocument(content)
        except pypdfium2.PdfiumError as error:
            if getattr(error, "err_code", None) == pdfium_c.FPDF_ERR_PASSWORD:
                raise InvalidArgument(
                    "content", "is an encrypted PDF; upload it without its password protection"
                ) from None
            raise not_valid("PDF", "PDFium cannot open it (damaged or truncated?)") from None


def _page_text(document: pypdfium2.PdfDocument, number: int) -> str:
    with unreadable_as("PDF"):
        try:
            page = document[number - 1]
        except pypdfium2.PdfiumError:
            raise not_valid("PDF", f"page {number} cannot be loaded (damaged?)") from None
        try:
            textpage = page.get_textpage()
            try:
                raw = textpage.get_text_range()
            finally:
                textpage.close()
        finally:
            page.close()
    return normalised(raw)


def normalised(raw: str) -> str:
    """A page's text from PDFium, normalised as the module docstring says."""
    text = _CONTROL.sub("", raw.replace("\r\n", "\n").replace("\r", "\n"))
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_RUN.sub("\n\n", text).strip("\n")
