"""What every embedder is: a pinned spec and async embedding of documents and queries.

A memory space or knowledge base records the `EmbedderSpec` of its first write; a later write or
search with a different spec is refused (re-embedding is an explicit operation, never implicit).

Contract of every `Embedder` (the conformance tests in tests/embedders check it):

- `embed_documents(texts)` returns a float32, C-contiguous array of shape `(len(texts), dimension)`;
  `embed_query(text)` returns shape `(dimension,)`. Row `i` belongs to `texts[i]`.
- Every value is finite. When `spec.normalized` is true every row has unit L2 norm (we normalise on
  our side rather than trust the endpoint), so inner product equals cosine similarity.
- All or nothing: a call either returns every vector or raises; there are no partial results.
- Endpoint failures raise `tokensvc.errors.EmbedderUnavailable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tokensvc.storage.records import MAX_DIMENSION, EmbedderSpec

__all__ = ["MAX_DIMENSION", "Embedder", "EmbedderSpec", "Vectors", "normalize_rows"]

Vectors = npt.NDArray[np.float32]


@runtime_checkable
class Embedder(Protocol):
    """Turns text into vectors of one fixed spec. See the module docstring for the contract."""

    @property
    def spec(self) -> EmbedderSpec: ...

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        """One row per text, in order; shape `(len(texts), spec.dimension)`."""
        ...

    async def embed_query(self, text: str) -> Vectors:
        """The vector a search uses; shape `(spec.dimension,)`."""
        ...

    async def aclose(self) -> None:
        """Release connections; the embedder is not used afterwards."""
        ...


def normalize_rows(matrix: npt.NDArray[np.floating]) -> Vectors:
    """Scale each row to unit L2 norm; returns a new float32 C-contiguous array.

    Raises ValueError if a row is zero or not finite: such a row has no direction, and silently
    returning NaN (0/0) would poison every later inner product.
    """
    work = np.asarray(matrix, dtype=np.float64)  # float64 so large float32 values cannot overflow
    if not np.isfinite(work).all():
        raise ValueError("vector has NaN or infinite values")
    norms = np.linalg.norm(work, axis=1, keepdims=True)
    if (norms == 0).any():
        raise ValueError("vector is all zeros")
    return np.ascontiguousarray(work / norms, dtype=np.float32)
