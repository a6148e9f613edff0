"""Vector normalisation for search: every stored and query vector has unit length.

The maths is the embedders' `normalize_rows` (float64, so the squares of large float32 components
cannot overflow); this adds the API's error: INVALID_ARGUMENT naming the field and the row. With
unit vectors, inner product is cosine similarity, which the HNSW index (`vector_ip_ops`) serves.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tokensvc.embedders.base import normalize_rows
from tokensvc.errors import InvalidArgument

__all__ = ["unit_rows", "unit_vector"]


def unit_rows(matrix: npt.ArrayLike, field: str) -> npt.NDArray[np.float32]:
    """Each row scaled to unit length, float32 and C-contiguous; INVALID_ARGUMENT naming `field`
    (with the row index) for a row that is zero or not finite."""
    wide = np.atleast_2d(np.asarray(matrix, dtype=np.float64))
    try:
        return normalize_rows(wide)
    except ValueError:
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.linalg.norm(wide, axis=1)
        bad = int(np.flatnonzero(~np.isfinite(norms) | (norms == 0.0))[0])
        where = field if wide.shape[0] == 1 else f"{field}[{bad}]"
        raise InvalidArgument(where, "must be a finite, non-zero vector") from None


def unit_vector(vector: npt.ArrayLike, field: str) -> npt.NDArray[np.float32]:
    """One vector scaled to unit length (see `unit_rows`)."""
    row: npt.NDArray[np.float32] = unit_rows(np.asarray(vector).reshape(1, -1), field)[0]
    return row
