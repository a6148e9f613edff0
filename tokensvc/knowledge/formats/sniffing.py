"""The media type of `application/octet-stream` content, recognised from its bytes' signature.

- `%PDF-` within the first 1,024 bytes (where PDF readers look for it): `application/pdf`;
- a zip archive (checked against the decompression-bomb limits first, see `archives`: a bomb is
  refused as such) with a `word/`, `ppt/` or `xl/` part: DOCX, PPTX or XLSX.

Anything else is refused: `InvalidArgument` naming the content-type field, saying which types can
be recognised and that others must be declared. This runs where the bytes are parsed (in the
extraction workers), never on the server's own process.
"""

from __future__ import annotations

from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.knowledge.formats.archives import check_archive
from tokensvc.knowledge.formats.documents import ExtractionLimits
from tokensvc.knowledge.formats.media_types import DOCX, OCTET_STREAM, PPTX, XLSX

__all__ = ["sniff_media_type"]

_PDF_HEADER_WITHIN = 1024
_OFFICE_PARTS = (("word/", DOCX), ("ppt/", PPTX), ("xl/", XLSX))


def sniff_media_type(content: bytes, limits: ExtractionLimits, field: str = "header.content_type") -> str:
    """The media type of `content` by its signature (see the module docstring)."""
    if b"%PDF-" in content[:_PDF_HEADER_WITHIN]:
        return "application/pdf"
    if content.startswith(b"PK\x03\x04"):
        try:
            names = check_archive(content, limits, "DOCX, PPTX or XLSX")
        except PayloadTooLarge:
            raise
        except InvalidArgument:  # no zip after all: no type recognised
            names = []
        for prefix, media_type in _OFFICE_PARTS:
            if any(name.startswith(prefix) for name in names):
                return media_type
    raise InvalidArgument(
        field,
        f"is {OCTET_STREAM}, and the content is not a PDF, DOCX, PPTX or XLSX file (the types its "
        "bytes can be recognised as); declare the document's content type",
    )
