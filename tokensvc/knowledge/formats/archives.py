"""The decompression-bomb check of zip-based formats (DOCX, PPTX, XLSX), before any parser runs.

`check_archive` reads only the archive's directory, never a compressed byte:

1. the End of Central Directory record (zip64 aware) at the end of the bytes: the number of
   entries is the larger of the one declared there and the count of entry signatures in the
   central directory it points at, so a record that lies about it still cannot make
   `zipfile` read hundreds of thousands of entries (seconds and 100+ MB for 200k);
2. `zipfile`'s list of entries: their declared total uncompressed size and, for entries above
   `_RATIO_FROM_BYTES`, their compression ratio.

Refusals are `PayloadTooLarge` on `content` ("a decompression bomb?") against `ExtractionLimits`
(`max_archive_entries`, `max_uncompressed_bytes`, `max_compression_ratio`); bytes that are no zip
archive are `InvalidArgument` ("is not a valid DOCX file: ..."). Declared sizes bound what the
parsers later inflate: Python's `zipfile` stops an entry at its declared size (and then fails its
CRC), and python-docx, python-pptx and openpyxl all read through it.
"""

from __future__ import annotations

import io
import struct
import zipfile

from tokensvc.errors import PayloadTooLarge
from tokensvc.knowledge.formats.documents import ExtractionLimits
from tokensvc.knowledge.formats.refusals import not_valid, over_limit, unreadable_as

__all__ = ["check_archive"]

_MIB = 1024 * 1024
_RATIO_FROM_BYTES = _MIB  # small parts compress well and harmlessly (a styles part: 32 to 1)
_BOMB = "a decompression bomb?"
_EOCD = struct.Struct("<4s4H2LH")  # signature, disks, entries here, entries, size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, record offset, disks
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # ..., entries here, entries, directory size, offset
_MAX_COMMENT = 0xFFFF


def check_archive(content: bytes, limits: ExtractionLimits, kind: str) -> list[str]:
    """Check the zip archive `content` (a `kind` file: DOCX...) against `limits`, and return
    its entries' names; refuse it (see the module docstring) when it is over a limit or no zip."""
    entries = _entry_count(content, kind)
    if entries > limits.max_archive_entries:
        raise over_limit(f"{entries:,}", "archive entries", limits.max_archive_entries, _BOMB)
    with unreadable_as(kind), zipfile.ZipFile(io.BytesIO(content)) as archive:
        infos = archive.infolist()  # the central directory only; nothing is inflated
    total = sum(info.file_size for info in infos)
    if total > limits.max_uncompressed_bytes:
        raise PayloadTooLarge(
            "content",
            f"unpacks to {total / _MIB:,.0f} MiB, more than the limit of "
            f"{limits.max_uncompressed_bytes / _MIB:,.0f} MiB ({_BOMB})",
        )
    for info in infos:
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size > _RATIO_FROM_BYTES and ratio > limits.max_compression_ratio:
            raise PayloadTooLarge(
                "content",
                f"has a part compressed {ratio:,.0f} to 1, more than the limit of "
                f"{limits.max_compression_ratio:g} ({_BOMB})",
            )
    return [info.filename for info in infos]


def _entry_count(content: bytes, kind: str) -> int:
    """The entries the archive's directory holds, read from its end records (see the module
    docstring), without listing them."""
    at = content.rfind(b"PK\x05\x06", max(0, len(content) - _EOCD.size - _MAX_COMMENT))
    if at < 0 or at + _EOCD.size > len(content):
        raise not_valid(kind, "it is not a zip archive (no end of central directory)")
    _, _, _, _, declared, directory_size, _, _ = _EOCD.unpack_from(content, at)
    record = at
    zip64 = _zip64_record(content, at)
    if zip64 is not None:
        record = zip64
        *_, declared, directory_size, _ = _ZIP64_EOCD.unpack_from(content, zip64)
    start = record - directory_size
    if start < 0:
        raise not_valid(kind, "its central directory lies outside the file")
    return max(int(declared), content.count(b"PK\x01\x02", start, record))


def _zip64_record(content: bytes, eocd: int) -> int | None:
    """The position of the zip64 end record, when a zip64 locator precedes the end record."""
    locator = eocd - _ZIP64_LOCATOR.size
    if locator < 0 or content[locator : locator + 4] != b"PK\x06\x07":
        return None
    _, _, offset, _ = _ZIP64_LOCATOR.unpack_from(content, locator)
    # Right before the locator in any archive we can read; else where the locator says.
    for candidate in (locator - _ZIP64_EOCD.size, offset):
        if candidate >= 0 and content[candidate : candidate + 4] == b"PK\x06\x06":
            return candidate
    return None
