"""Long-term memory's domain records (frozen; no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from tokensvc.embedders import EmbedderSpec
from tokensvc.memory.metadata import MetadataScalar

__all__ = ["MemoryRecord", "MemorySpace", "NewMemory", "ScoredMemory", "StoredRef"]


@dataclass(frozen=True)
class MemoryRecord:
    id: str
    content: str = field(repr=False)
    metadata: dict[str, MetadataScalar] = field(repr=False)
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    embedder: str


@dataclass(frozen=True)
class NewMemory:
    """A memory ready to store: validated, hashed, embedded (unit length)."""

    id: str
    content: str = field(repr=False)
    content_sha256: bytes
    metadata: dict[str, MetadataScalar] = field(repr=False)
    idempotency_key: str | None
    ttl_seconds: int | None
    embedding: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class StoredRef:
    """Where an item of a Remember batch ended up."""

    id: str
    content_sha256: bytes
    idempotency_key: str | None
    inserted: bool


@dataclass(frozen=True)
class ScoredMemory:
    memory: MemoryRecord
    score: float


@dataclass(frozen=True)
class MemorySpace:
    """What a memory space pins at its first write: the embedder and the text-search config."""

    embedder: EmbedderSpec
    text_config: str
