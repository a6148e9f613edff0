"""Knowledge bases' domain records (frozen; no I/O): the store port's records."""

from __future__ import annotations

from tokensvc.storage.records import BaseRow, ChunkRow, DocumentRow, DocumentState, PassageRow

__all__ = ["BaseRow", "ChunkRow", "DocumentRow", "DocumentState", "PassageRow"]
