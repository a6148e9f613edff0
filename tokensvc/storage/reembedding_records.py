"""The records of re-embedding migrations that its store ports take and return: a memory space's
and a knowledge base's migration (two types), their states, and the rows a backfill reads.
Plain frozen dataclasses, no I/O, as `records.py`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from datetime import datetime
from typing import ClassVar, Self, TypeAlias

from tokensvc.storage.records import ChunkingSpec, EmbedderSpec, SourceSpan, StoredChunk

__all__ = [
    "EmbeddingMigration",
    "EmbeddingMigrationBase",
    "KnowledgeBaseMigration",
    "MemorySpaceMigration",
    "MigrationState",
    "PendingDocument",
    "PendingMemory",
]


# --- re-embedding migrations -------------------------------------------------------------------


class MigrationState(enum.StrEnum):
    """Where a re-embedding migration is (docs/operations.md has the state machine).

    BACKFILLING -> RETIRING (at the cutover) -> SUCCEEDED; BACKFILLING <-> PAUSED (a persistent
    embedder failure; resumed by an operator); BACKFILLING or PAUSED -> CANCELLING -> CANCELLED.
    """

    BACKFILLING = "backfilling"
    PAUSED = "paused"
    RETIRING = "retiring"
    SUCCEEDED = "succeeded"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """Holds the space's other vector slot: no second migration of the space may start."""
        return self not in (MigrationState.SUCCEEDED, MigrationState.CANCELLED)

    @property
    def runnable(self) -> bool:
        """Has work for a runner."""
        return self in (MigrationState.BACKFILLING, MigrationState.RETIRING, MigrationState.CANCELLING)


@dataclass(frozen=True, kw_only=True)
class EmbeddingMigrationBase:
    """What every re-embedding migration has, whatever it moves: its subject's move from the
    pinned embedder (`source`) to `target`, where it is and who holds its lease. A migration is one
    of two kinds (`EmbeddingMigration`), each with its own subject and its own backfill cursor."""

    # What the monitoring calls the kind ("memory_space", "knowledge_base").
    kind: ClassVar[str]

    id: str
    namespace: str
    from_generation: int
    source: EmbedderSpec
    target: EmbedderSpec
    state: MigrationState
    created_by: str
    reason: str = ""
    rows_total: int = 0
    rows_done: int = 0
    failures: int = 0  # consecutive embedder failures
    lease_owner: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    cut_over_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def paused(self) -> bool:
        """Waits for an operator (a persistent embedder failure paused it)."""
        return self.state is MigrationState.PAUSED


@dataclass(frozen=True, kw_only=True)
class MemorySpaceMigration(EmbeddingMigrationBase):
    """One memory space's (namespace, agent) move to another embedder, through the vector slot
    the space does not read."""

    kind: ClassVar[str] = "memory_space"

    agent: str
    # Where the backfill has got to, in (bucket, id) order (None: from the start).
    cursor: tuple[str, str] | None = None

    @property
    def subject(self) -> str:
        """What it migrates, as audit targets name it."""
        return f"space:{self.namespace}/{self.agent}"

    @property
    def at_start(self) -> bool:
        """The backfill's cursor is at the start of the space."""
        return self.cursor is None

    def rewound(self) -> Self:
        """The migration with its cursor back at the start (the pass that catches rows written
        behind it)."""
        return replace(self, cursor=None)

    @property
    def target_slot(self) -> int:
        """The vector slot the migration fills (the one the space does not read yet)."""
        return (self.from_generation + 1) % 2


@dataclass(frozen=True, kw_only=True)
class KnowledgeBaseMigration(EmbeddingMigrationBase):
    """One knowledge base's (namespace, kb_ref) move to another embedder and from its chunking
    (`source_chunking`) to `target_chunking`, the same strategy when only the embedder changes,
    through the base's next chunk generation."""

    kind: ClassVar[str] = "knowledge_base"

    kb_ref: str
    source_chunking: ChunkingSpec
    target_chunking: ChunkingSpec
    # The last document done, in ref order (None: from the start).
    document_cursor: str | None = None

    @property
    def subject(self) -> str:
        """What it migrates, as audit targets name it."""
        return f"knowledge_base:{self.namespace}/{self.kb_ref}"

    @property
    def at_start(self) -> bool:
        """The backfill's cursor is at the start of the base."""
        return self.document_cursor is None

    def rewound(self) -> Self:
        """The migration with its cursor back at the start."""
        return replace(self, document_cursor=None)

    @property
    def rechunks(self) -> bool:
        """The documents are cut again (the chunking changes), not only embedded again."""
        return self.target_chunking != self.source_chunking


# A re-embedding migration, of one kind or the other: code dispatches on the type.
EmbeddingMigration: TypeAlias = MemorySpaceMigration | KnowledgeBaseMigration


@dataclass(frozen=True)
class PendingMemory:
    """A live memory the migration has not embedded yet."""

    bucket: str
    id: str
    content: str
    content_sha256: bytes


@dataclass(frozen=True)
class PendingDocument:
    """A document whose current version a knowledge-base migration has not written yet: its
    stored text (None: uploaded before texts were stored) with its source spans, and its current
    chunks, embedding-less, when the migration keeps the chunking."""

    ref: str
    version: int
    content_sha256: bytes
    text: str | None
    chunks: tuple[StoredChunk, ...] = ()
    spans: tuple[SourceSpan, ...] = ()
