"""Embedding stored texts in batches (document chunks, memories being re-embedded): the batch
size an embedder wants, and a batch embedded as checked unit vectors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from opentelemetry import trace

from tokensvc.embedders import Demand, ScheduledEmbedder
from tokensvc.errors import EmbedderUnavailable
from tokensvc.observability.metrics import observe_embedding
from tokensvc.retrieval.vectors import unit_vector

__all__ = ["batch_size_of", "embed_texts"]

_tracer = trace.get_tracer("tokensvc.retrieval")
_DEFAULT_BATCH = 64


def batch_size_of(embedder: ScheduledEmbedder) -> int:
    """The embedder's own batch size when it has one (the local model, OpenAI-compatible servers)."""
    size = getattr(embedder, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else _DEFAULT_BATCH


async def embed_texts(
    embedder: ScheduledEmbedder, texts: Sequence[str], demand: Demand, *, span: str = "embed.batch"
) -> np.ndarray:
    """`texts` embedded as unit vectors; a wrong shape is the embedder's failure (counted as
    one by a job's retries, like the embedder being away)."""
    with _tracer.start_as_current_span(span) as current:
        current.set_attribute("tokensvc.embed.count", len(texts))
        vectors = await observe_embedding(
            embedder.spec.name, embedder.embed_documents(list(texts), demand), texts=len(texts)
        )
        if vectors.ndim != 2 or vectors.shape[1] != embedder.spec.dimension:
            raise EmbedderUnavailable(
                f"the embedder returned vectors of shape {vectors.shape}, not "
                f"{embedder.spec.dimension} dimensions"
            )
        return np.stack([unit_vector(v, "embedding") for v in vectors])
