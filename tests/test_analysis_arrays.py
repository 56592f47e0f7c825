"""The grouped sums the statistics use in place of ``np.add.at`` and ``np.unique``: the same numbers, bit for bit,
so an analysis.json does not change with them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp

from splitstream.analysis.arrays import add_rows, dense_codes


@settings(max_examples=200, deadline=None)
@given(
    hs.integers(1, 30),
    hs.integers(1, 5),
    hs.data(),
)
def test_add_rows_gives_np_add_at_sums_bit_for_bit(rows: int, columns: int, data: hs.DataObject) -> None:
    n = data.draw(hs.integers(0, 200))
    index = data.draw(hnp.arrays(np.int64, n, elements=hs.integers(0, rows - 1)))
    values = data.draw(hnp.arrays(np.float64, (n, columns), elements=hs.floats(-1e12, 1e12, width=64)))
    expected = np.zeros((rows, columns))
    np.add.at(expected, index, values)
    got = add_rows(np.zeros((rows, columns)), index, values)
    assert got.tobytes() == expected.tobytes()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int64, hs.integers(0, 300), elements=hs.integers(-5, 10**6)))
def test_dense_codes_rank_labels_as_np_unique_does(labels: np.ndarray) -> None:  # type: ignore[type-arg]
    expected = np.unique(labels, return_inverse=True)[1].reshape(-1)
    assert dense_codes(labels).tolist() == expected.tolist()
