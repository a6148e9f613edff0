"""A backfill, whichever its kind: what the runner asks of one (`Backfill`, run through the
`BatchPipeline` lent to it), and what both kinds share (the batch size, the scheduler's demand,
embedding a batch of texts: `tokensvc.retrieval.document_embedding`'s, re-exported).

The seam between the pipeline and the kinds: the pipeline (`pipeline.BatchPipeline`, under the
job runner's lease, backoff and pause) reads ahead, passes again and cuts over, whatever the
migration moves; a memory space's backfill (`memory_backfill`) and a knowledge base's
(`knowledge_backfill`) say how their batches are read, embedded and written.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from tokensvc.embedders import Demand, ScheduledEmbedder, WorkClass
from tokensvc.reembedding.pipeline import BatchPipeline
from tokensvc.retrieval.document_embedding import batch_size_of, embed_texts
from tokensvc.storage.reembedding_records import EmbeddingMigration

__all__ = ["Backfill", "batch_size_of", "bulk_demand", "embed_texts"]

_Migration_contra = TypeVar("_Migration_contra", bound=EmbeddingMigration, contravariant=True)


class Backfill(Protocol[_Migration_contra]):
    """One kind's backfill (a memory space's, a knowledge base's)."""

    # What its rows are called in the audit trail ("memories", "documents").
    rows: str
    # Rows per clean-up transaction when its old or abandoned vectors are emptied.
    clear_limit: int

    async def backfill(
        self, migration: _Migration_contra, embedder: ScheduledEmbedder, size: int, pipeline: BatchPipeline
    ) -> None:
        """Run the migration's backfill through `pipeline`, embedding with the (checked) target
        `embedder` in batches of `size` texts."""
        ...


def bulk_demand(migration: EmbeddingMigration) -> Demand:
    """A migration's batches: bulk work, in its namespace's fair share."""
    return Demand.of(WorkClass.BULK, migration.namespace)
