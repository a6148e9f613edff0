"""Knowledge bases: text extraction, chunking strategies, their records and the corpus service."""

from __future__ import annotations

from tokensvc.knowledge.chunking import Chunk, ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.extraction_pool import ExtractionPool
from tokensvc.knowledge.formats import SUPPORTED_CONTENT_TYPES, Location, extract_text, parse_content_type
from tokensvc.knowledge.ingestion import IngestionRunner, IngestionSettings
from tokensvc.knowledge.models import BaseRow, ChunkRow, DocumentRow, DocumentState, PassageRow

__all__ = [
    "SUPPORTED_CONTENT_TYPES",
    "BaseRow",
    "Chunk",
    "ChunkRow",
    "ChunkingKind",
    "ChunkingStrategy",
    "DocumentRow",
    "DocumentState",
    "ExtractionPool",
    "IngestionRunner",
    "IngestionSettings",
    "Location",
    "PassageRow",
    "chunk_document",
    "extract_text",
    "parse_content_type",
]
