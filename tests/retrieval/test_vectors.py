"""Search-side normalisation: unit rows in float32, huge components safe, bad rows named."""

from __future__ import annotations

import numpy as np
import pytest

from tokensvc.errors import InvalidArgument
from tokensvc.retrieval import unit_rows, unit_vector


def test_rows_come_back_unit_length_float32_even_with_huge_components() -> None:
    rows = unit_rows(np.array([[3e38, 3e38, 0.0], [1.0, 2.0, 2.0]], dtype=np.float32), "items")
    assert rows.dtype == np.float32
    assert rows.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(rows[1], [1 / 3, 2 / 3, 2 / 3], atol=1e-6)
    np.testing.assert_allclose(unit_vector([0.0, 5.0], "query_vector"), [0.0, 1.0])


@pytest.mark.parametrize(("bad", "field"), [([0.0, 0.0], "items[1]"), ([np.nan, 1.0], "items[1]")])
def test_a_zero_or_non_finite_row_is_invalid_argument_naming_its_index(bad: list[float], field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        unit_rows(np.array([[1.0, 0.0], bad]), "items")
    assert refused.value.field == field
    with pytest.raises(InvalidArgument) as single:
        unit_vector(bad, "query_vector")
    assert single.value.field == "query_vector"
