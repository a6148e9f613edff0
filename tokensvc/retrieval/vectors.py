"""Vector normalisation, the one place it happens: every stored and query vector has unit length.

In float64: the squares of large float32 components overflow float32 but not float64. With unit
vectors, inner product is cosine similarity, which the HNSW index (`vector_ip_ops`) serves.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tokensvc.errors import InvalidArgument

__all__ = ["unit_rows", "unit_vector"]


def unit_rows(matrix: npt.ArrayLike, field: str) -> npt.NDArray[np.float32]:
    """Each row scaled to unit length, float32 and C-contiguous; INVALID_ARGUMENT naming `field`
    (with the row index) for a row that is zero or not finite."""
    wide = np.atleast_2d(np.asarray(matrix, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(wide, axis=1)
    bad = np.flatnonzero(~np.isfinite(norms) | (norms == 0.0))
    if bad.size:
        where = field if wide.shape[0] == 1 else f"{field}[{int(bad[0])}]"
        raise InvalidArgument(where, "must be a finite, non-zero vector")
    return np.ascontiguousarray(wide / norms[:, None], dtype=np.float32)


def unit_vector(vector: npt.ArrayLike, field: str) -> npt.NDArray[np.float32]:
    """One vector scaled to unit length (see `unit_rows`)."""
    row: npt.NDArray[np.float32] = unit_rows(np.asarray(vector).reshape(1, -1), field)[0]
    return row
