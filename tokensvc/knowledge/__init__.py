"""Knowledge bases: text extraction, chunking strategies and the corpus service."""

from __future__ import annotations

from tokensvc.knowledge.chunking import Chunk, ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.extract import SUPPORTED_CONTENT_TYPES, extract_text, parse_content_type

__all__ = [
    "SUPPORTED_CONTENT_TYPES",
    "Chunk",
    "ChunkingKind",
    "ChunkingStrategy",
    "chunk_document",
    "extract_text",
    "parse_content_type",
]
