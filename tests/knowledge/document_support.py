"""What the document-format tests share: the vendored third-party files (fixtures/documents, see
its MANIFEST.tsv), small Office files made with the same libraries the server reads them with,
and hostile archives built in memory (decompression bombs are cheap to make, costly to vendor)."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import docx
import openpyxl
import pptx
from docx.document import Document
from openpyxl.workbook import Workbook
from pptx.presentation import Presentation

DOCUMENTS = Path(__file__).parent / "fixtures" / "documents"
MIB = 1024 * 1024

DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
PPTX = "application/vnd.openxmlformats-officedocument.presentationml.presentation"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"


def document(name: str) -> bytes:
    """A vendored file: `r-intro.pdf`, `hostile/scanned-no-text.pdf`..."""
    return (DOCUMENTS / name).read_bytes()


def made_docx(build: Callable[[Document], object]) -> bytes:
    made = docx.Document()
    build(made)
    return _saved(made)


def made_pptx(build: Callable[[Presentation], object]) -> bytes:
    made = pptx.Presentation()
    build(made)
    return _saved(made)


def made_xlsx(build: Callable[[Workbook], object]) -> bytes:
    made = openpyxl.Workbook()
    build(made)
    return _saved(made)


def _saved(made: Document | Presentation | Workbook) -> bytes:
    out = io.BytesIO()
    made.save(out)
    return out.getvalue()


def rebuilt(archive: bytes, replace: dict[str, bytes] | None = None, extra: int = 0) -> bytes:
    """`archive` with parts replaced (or added) and `extra` empty entries added."""
    replace = dict(replace or {})
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(archive)) as source,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as made,
    ):
        for info in source.infolist():
            made.writestr(info.filename, replace.pop(info.filename, None) or source.read(info.filename))
        for name, data in replace.items():
            made.writestr(name, data)
        for number in range(extra):
            made.writestr(f"customXml/empty{number}.xml", b"")
    return out.getvalue()


def padded(archive: bytes, part: str, after: bytes, size: int) -> bytes:
    """`archive` with `size` bytes of spaces in `part` right after `after` (still valid XML):
    compressed about 1,000 to 1."""
    with zipfile.ZipFile(io.BytesIO(archive)) as source:
        head, marker, tail = source.read(part).partition(after)
    return rebuilt(archive, {part: head + marker + b" " * size + tail})


def understated(archive: bytes, part: str, size: int) -> bytes:
    """`padded`, but the archive's headers declare the part's original size: a lying directory."""
    with zipfile.ZipFile(io.BytesIO(archive)) as source:
        original = source.getinfo(part).file_size
    data = bytearray(padded(archive, part, b">", size))
    name = part.encode()
    for signature, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        at = data.find(signature)
        while data[at + name_at : at + name_at + len(name)] != name:
            at = data.find(signature, at + 1)
        data[at + size_at : at + size_at + 4] = struct.pack("<I", original)
    return bytes(data)
