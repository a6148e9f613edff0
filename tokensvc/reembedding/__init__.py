"""Re-embedding: a memory space or a knowledge base moves to another embedder (a knowledge base
optionally to another chunking strategy too) while it serves (issue 16).

`EmbeddingMigrations` (`operations`) is what operators call (start, dry run, status, list,
cancel, resume); `MigrationRunner` (`runner`) is the background worker every replica runs: one
kind of job of `tokensvc.jobs`, whose runner claims, leases, backs off and pauses. The state
lives in PostgreSQL (`EmbeddingMigrationStore`); one runner at a time holds a migration's lease,
renewed while it works and with every batch, and another replica takes it over when the lease
expires. A migration is a `MemorySpaceMigration` or a `KnowledgeBaseMigration`. The state
machine:

    BACKFILLING --(every live memory has a target vector: the cutover)--> RETIRING --> SUCCEEDED
    BACKFILLING <--(persistent embedder failure / resume)--> PAUSED
    BACKFILLING | PAUSED --(cancel)--> CANCELLING --> CANCELLED

BACKFILLING (`memory_backfill`) embeds the space's memories with the target embedder into the
vector slot the space does not read, in batches of the embedder's size, each batch committed with
the cursor and the progress (a runner killed mid-batch redoes that batch only). Memories written
meanwhile are caught by a second pass from the start; the cutover itself checks, with every write
of the space held off, that nothing is missing, pins the target and bumps the space's generation
in one transaction. Until then searches read the current slot only; from then on, the target slot
only. RETIRING is claimed `retire_seconds` after the cutover (longer than any replica caches a
pin, so a search that embedded its query with the old model still finds the old vectors), then
empties the old slot. CANCELLING empties the target slot: nothing a search reads ever changed.

A knowledge base's migration is the same machine over documents instead of memories
(`knowledge_backfill`): its backfill writes every current document's chunks of the base's next
generation (re-chunked from the document's stored text when the chunking changes), uploads
meanwhile write both generations, and the cutover pins the target and bumps the base's
generation; searches read one generation.

Re-embedding sits above `tokensvc.memory` and `tokensvc.knowledge` (it re-chunks with
`tokensvc.knowledge.chunking`); neither imports it (`tests/test_layering.py`).
"""

from __future__ import annotations

from tokensvc.reembedding.backfill import batch_size_of
from tokensvc.reembedding.operations import (
    EmbeddingMigrations,
    MigrationConflict,
    MigrationEstimate,
    MigrationProgress,
)
from tokensvc.reembedding.runner import MigrationRunner, RunnerSettings
from tokensvc.storage.records import ChunkingSpec
from tokensvc.storage.reembedding_records import (
    EmbeddingMigration,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationState,
)

__all__ = [
    "ChunkingSpec",
    "EmbeddingMigration",
    "EmbeddingMigrations",
    "KnowledgeBaseMigration",
    "MemorySpaceMigration",
    "MigrationConflict",
    "MigrationEstimate",
    "MigrationProgress",
    "MigrationRunner",
    "MigrationState",
    "RunnerSettings",
    "batch_size_of",
]
