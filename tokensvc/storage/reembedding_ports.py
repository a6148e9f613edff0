"""The re-embedding ports: a migration's durable state, the lease of the one runner at a time,
and the runner's batches, split by what each caller needs (a caller takes the narrowest).

    MigrationStateStore       get, transition                      both callers
    MigrationOperationsStore  + create, page, active, sizes        the operator's calls
    MemoryBackfillStore       pending, store_vectors               a memory space's backfill
    KnowledgeBackfillStore    pending_documents, store_documents   a knowledge base's backfill
    MigrationRunnerStore      + both backfills' and claim, renew,  the runner (it hands each
                              rewind, cut_over, clear_slot,        backfill its own port)
                              record_failure
    EmbeddingMigrationStore   all of them                          every implementation

Every runner call (those of `MigrationRunnerStore`, the backfill ports' included) names the runner
(`runner`, or the migration's `lease_owner`) and does nothing (returning None, False or nothing)
when that runner does not hold the migration's unexpired lease; a batch and its progress commit
together, so a runner killed mid-batch leaves that batch to do again and nothing else.
Re-exported by `tokensvc.storage.ports`, whose common rules apply.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Protocol

import numpy as np

from tokensvc.storage.records import ChunkRow
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
    PendingDocument,
    PendingMemory,
)

__all__ = [
    "EmbeddingMigrationStore",
    "KnowledgeBackfillStore",
    "MemoryBackfillStore",
    "MigrationOperationsStore",
    "MigrationRunnerStore",
    "MigrationStateStore",
]


class MigrationStateStore(Protocol):
    """A migration's durable state: read it, move it (the operator's calls and the runner)."""

    async def get(self, migration_id: str) -> EmbeddingMigration | None:
        """The migration with this id."""

    async def transition(
        self, migration_id: str, *, expect: Sequence[MigrationState], state: MigrationState, reason: str = ""
    ) -> EmbeddingMigration | None:
        """Move the migration to `state` (with `reason`; failures reset) when it is in one of
        `expect`, releasing its lease; None when it is not (or does not exist). SUCCEEDED and
        CANCELLED also set `finished_at`."""


class MigrationOperationsStore(MigrationStateStore, Protocol):
    """What the operator's calls need (MigrationService): record a migration, list the
    migrations, and size the memory space or knowledge base a migration would move."""

    async def create(self, migration: EmbeddingMigration) -> EmbeddingMigration | None:
        """Record `migration` (state BACKFILLING, no lease), after making sure the target
        dimension can be indexed; returned as stored, of its own kind. None (nothing recorded)
        when the space (base) already has an active migration (`MigrationState.active`) or its generation is no longer
        `migration.from_generation`. A knowledge base's documents start with no next-generation
        chunks written (`pending_documents` lists them all). A space's `rows_total` is kept as
        given, the caller's `space_size` (a count over every bucket: on Citus every shard, so a
        start counts once); a knowledge base's is set to its documents now."""

    async def page(self, *, limit: int, before: tuple[datetime, str] | None) -> list[EmbeddingMigration]:
        """Up to `limit` migrations newest first (created_at, then id, descending), strictly
        before the cursor (created_at, id)."""

    async def active(self) -> list[EmbeddingMigration]:
        """Every migration not finished (its state `active`: backfilling, paused, retiring or
        cancelling), oldest first."""

    async def space_size(self, namespace: str, agent: str) -> tuple[int, int]:
        """The space's live memories and their average length in characters (no content)."""

    async def base_size(self, namespace: str, kb_ref: str) -> tuple[int, int, int, int]:
        """A knowledge base's documents, their current chunks, the chunks' average length in
        characters, and how many documents have no stored text (uploaded before texts were kept)."""


class MemoryBackfillStore(Protocol):
    """A memory space's backfill: the runner's batches over every bucket of the space
    (`MemoryStore`'s rows)."""

    async def pending(self, migration: MemorySpaceMigration, *, limit: int) -> list[PendingMemory]:
        """Up to `limit` live memories of the space without a vector in the target slot, in
        (bucket, id) order strictly after `migration.cursor` (from the start when None); for the
        runner holding the BACKFILLING migration's lease (`migration.lease_owner`) only: nothing
        otherwise."""

    async def store_vectors(
        self,
        migration: MemorySpaceMigration,
        runner: str,
        rows: Sequence[tuple[PendingMemory, np.ndarray]],
        *,
        lease_seconds: float,
    ) -> MemorySpaceMigration | None:
        """In one transaction: write each vector to its memory's target slot unless the memory
        is gone or its content changed since it was read; move the cursor to the last row;
        count the rows written in `rows_done` (and `rows_total` when more were written than
        counted); reset `failures`; renew the lease. Returns the migration as stored, None (nothing
        written) when `runner` does not hold the lease or the migration is no longer BACKFILLING."""


class KnowledgeBackfillStore(Protocol):
    """A knowledge base's backfill: the runner's batches over the base's documents
    (`KnowledgeStore`'s rows)."""

    async def pending_documents(
        self, migration: KnowledgeBaseMigration, *, limit: int
    ) -> list[PendingDocument]:
        """A knowledge base's backfill: up to `limit` documents whose current version has no
        next-generation chunks, in ref order strictly after `migration.document_cursor`, each with
        its stored text and, when the migration keeps the chunking, its current chunks; for the
        runner holding the BACKFILLING migration's lease only: nothing otherwise."""

    async def store_documents(
        self,
        migration: KnowledgeBaseMigration,
        runner: str,
        documents: Sequence[tuple[PendingDocument, Sequence[ChunkRow]]],
        *,
        lease_seconds: float,
    ) -> KnowledgeBaseMigration | None:
        """In one transaction: each document's next-generation chunks (written whole, unless the
        document has a newer version or is gone); the cursor moved to the last document; the
        documents written counted in `rows_done`; failures reset; the lease renewed. None (nothing
        written) when `runner` does not hold the lease or the migration is not BACKFILLING."""


class MigrationRunnerStore(MigrationStateStore, MemoryBackfillStore, KnowledgeBackfillStore, Protocol):
    """What the runner needs: claim a migration and hold its lease, its backfills' batches, the
    end of a pass, the cutover, the clean-up, and the embedder's failures."""

    async def claim(
        self,
        runner: str,
        *,
        lease_seconds: float,
        embedders: Sequence[str],
        retire_after_seconds: float,
        busy: Collection[str] = (),
    ) -> EmbeddingMigration | None:
        """Take (or renew) the lease of the oldest runnable migration whose lease is free,
        expired or `runner`'s own, other than those in `busy` (the ids `runner` is driving
        already); a BACKFILLING one only when its target embedder is among `embedders` (this
        runner can embed for it), a RETIRING one only `retire_after_seconds` after its cutover.
        None when there is none."""

    async def renew(self, migration: EmbeddingMigration, runner: str, *, lease_seconds: float) -> bool:
        """Extend `runner`'s lease (an expired one too, when no runner has taken it since); False
        when another runner holds the migration or it is not runnable."""

    async def rewind(self, migration: EmbeddingMigration, runner: str) -> bool:
        """Set the cursor back to the start (the pass that catches rows written behind it)."""

    async def cut_over(self, migration: EmbeddingMigration, runner: str) -> bool:
        """The atomic switch, ordered with every write of the space: when every live memory has a
        vector in the target slot, pin the target embedder, bump the space's generation (searches
        and writes use the target slot from then on), move to RETIRING and record the audit event
        (kind `embedding_migration`, action `cut over embedding migration`), all at once. False
        (nothing changed) when a memory still lacks one, or `runner` does not hold the lease.

        A knowledge base's: when every document's current version has its next-generation chunks,
        pin the target embedder and chunking, bump the base's generation and take each document's
        chunk count from them, with the same state change and audit event; a base deleted since
        the migration started moves it to CANCELLED instead (and returns False)."""

    async def clear_slot(
        self, migration: EmbeddingMigration, runner: str, *, limit: int, lease_seconds: float
    ) -> tuple[int, EmbeddingMigration] | None:
        """Empty the vector slot the migration leaves behind in the next `limit` memories of the
        space after `migration.cursor` ((bucket, id) order), expired ones too: RETIRING, the old
        generation's; CANCELLING, the target's. Returns how many (0: none left) and the migration
        with its cursor moved past them, its lease renewed; None when `runner` does not hold the
        lease. A knowledge base's: delete the chunks of the generation left behind of up to
        `limit` documents (returning how many chunks)."""

    async def record_failure(
        self, migration: EmbeddingMigration, runner: str, reason: str, *, pause_after: int
    ) -> EmbeddingMigration | None:
        """Count a consecutive embedder failure; at `pause_after` of them move to PAUSED with
        `reason` (and release the lease). None when `runner` does not hold the lease."""


class EmbeddingMigrationStore(MigrationOperationsStore, MigrationRunnerStore, Protocol):
    """Re-embedding migrations of memory spaces and knowledge bases, whole: every port above, as
    each implementation provides them (one store object serves the operator's calls and the
    runner); the conformance suite checks it."""
