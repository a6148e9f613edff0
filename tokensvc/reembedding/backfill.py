"""A backfill, whichever its kind: what the runner asks of one (`Backfill`, run through the
`BatchPipeline` lent to it), and what both kinds share (the batch size, the scheduler's demand,
embedding a batch of texts).

The seam between the pipeline and the kinds: the pipeline (`pipeline.BatchPipeline`, under the
job runner's lease, backoff and pause) reads ahead, passes again and cuts over, whatever the
migration moves; a memory space's backfill (`memory_backfill`) and a knowledge base's
(`knowledge_backfill`) say how their batches are read, embedded and written.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import numpy as np
from opentelemetry import trace

from tokensvc.embedders import Demand, ScheduledEmbedder, WorkClass
from tokensvc.errors import EmbedderUnavailable
from tokensvc.observability.metrics import observe_embedding
from tokensvc.reembedding.pipeline import BatchPipeline
from tokensvc.retrieval import unit_vector
from tokensvc.storage.reembedding_records import EmbeddingMigration

__all__ = ["Backfill", "batch_size_of", "bulk_demand", "embed_texts"]

_tracer = trace.get_tracer("tokensvc.reembedding")
_DEFAULT_BATCH = 64
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


def batch_size_of(embedder: ScheduledEmbedder) -> int:
    """The embedder's own batch size when it has one (the local model, OpenAI-compatible servers)."""
    size = getattr(embedder, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else _DEFAULT_BATCH


def bulk_demand(migration: EmbeddingMigration) -> Demand:
    """A migration's batches: bulk work, in its namespace's fair share."""
    return Demand.of(WorkClass.BULK, migration.namespace)


async def embed_texts(embedder: ScheduledEmbedder, texts: list[str], demand: Demand) -> np.ndarray:
    """`texts` embedded by the target, as unit vectors; a wrong shape is the embedder's failure."""
    with _tracer.start_as_current_span("reembedding.batch") as span:
        span.set_attribute("tokensvc.embed.count", len(texts))
        vectors = await observe_embedding(
            embedder.spec.name, embedder.embed_documents(texts, demand), texts=len(texts)
        )
        if vectors.ndim != 2 or vectors.shape[1] != embedder.spec.dimension:
            # Counted as the embedder's failure (it pauses the migration if it persists).
            raise EmbedderUnavailable(
                f"the embedder returned vectors of shape {vectors.shape}, not "
                f"{embedder.spec.dimension} dimensions"
            )
        return np.stack([unit_vector(v, "embedding") for v in vectors])
