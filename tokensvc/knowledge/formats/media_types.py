"""Every media type a document may be uploaded as, with the file-name extensions that map to it.

One table, read by the extractor registry (`tokensvc.knowledge.formats`), by clients that infer a
type from a file name (`media_type_for_filename`), and by `docs/api.md`'s list (a test compares).
A *text* type takes a `charset` parameter (UTF-8 only); a binary type ignores its parameters.
`application/octet-stream` is not a format: it asks the server to recognise the bytes (PDF,
DOCX, PPTX or XLSX by their signature, see `sniffing`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CODE_MEDIA_TYPES",
    "DOCX",
    "MEDIA_TYPES",
    "OCTET_STREAM",
    "PPTX",
    "XLSX",
    "MediaType",
    "media_type_for_filename",
]

DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
PPTX = "application/vnd.openxmlformats-officedocument.presentationml.presentation"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
OCTET_STREAM = "application/octet-stream"


@dataclass(frozen=True)
class MediaType:
    """A supported media type: its name, whether it is text (takes `charset`), its extensions
    (lower case, with the dot)."""

    name: str
    text: bool
    extensions: tuple[str, ...] = ()


# Source code and configuration: extracted verbatim, as text/plain is.
_CODE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("text/x-python", (".py", ".pyi")),
    ("text/x-go", (".go",)),
    ("text/x-java", (".java",)),
    ("text/x-kotlin", (".kt", ".kts")),
    ("text/x-scala", (".scala",)),
    ("text/x-c", (".c", ".h")),
    ("text/x-c++", (".cc", ".cpp", ".cxx", ".hh", ".hpp", ".hxx")),
    ("text/x-csharp", (".cs",)),
    ("text/x-rust", (".rs",)),
    ("text/x-swift", (".swift",)),
    ("text/x-ruby", (".rb",)),
    ("text/x-php", (".php",)),
    ("text/javascript", (".js", ".mjs", ".cjs", ".jsx")),
    ("text/x-typescript", (".ts", ".tsx", ".mts", ".cts")),
    ("text/x-shellscript", (".sh", ".bash", ".zsh")),
    ("text/x-sql", (".sql",)),
    ("text/x-protobuf", (".proto",)),
    ("text/css", (".css",)),
    ("application/xml", (".xml",)),
    ("application/yaml", (".yaml", ".yml")),
    ("application/toml", (".toml",)),
)
CODE_MEDIA_TYPES: tuple[str, ...] = tuple(name for name, _ in _CODE)

MEDIA_TYPES: tuple[MediaType, ...] = (
    MediaType("text/plain", True, (".txt", ".text", ".log")),
    MediaType("text/markdown", True, (".md", ".markdown")),
    MediaType("text/html", True, (".html", ".htm")),
    MediaType("application/pdf", False, (".pdf",)),
    MediaType(DOCX, False, (".docx",)),
    MediaType(PPTX, False, (".pptx",)),
    MediaType(XLSX, False, (".xlsx",)),
    MediaType("text/csv", True, (".csv",)),
    MediaType("application/json", True, (".json",)),
    MediaType("application/jsonl", True, (".jsonl",)),
    MediaType("application/x-ndjson", True, (".ndjson",)),
    *(MediaType(name, True, extensions) for name, extensions in _CODE),
    MediaType(OCTET_STREAM, False),
)

_BY_EXTENSION = {extension: media.name for media in MEDIA_TYPES for extension in media.extensions}


def media_type_for_filename(name: str) -> str | None:
    """The media type of a file named `name` by its extension (case-insensitive), or None."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1].lower()
    stem, dot, extension = base.rpartition(".")
    if not dot or not stem:
        return None
    return _BY_EXTENSION.get("." + extension)
