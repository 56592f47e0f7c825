"""The grouped sums the statistics use in place of ``np.add.at`` and ``np.unique``: the same numbers, bit for bit,
so an analysis.json does not change with them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp

from splitstream.analysis.arrays import RowCells, add_rows, add_selected_rows, dense_codes, head, row_totals


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


@settings(max_examples=200, deadline=None)
@given(hs.integers(1, 30), hs.integers(1, 5), hs.data())
def test_row_cells_add_the_dense_rows_sums_bit_for_bit(rows: int, columns: int, data: hs.DataObject) -> None:
    """The DuckDB engine's per-row sums by their cells give the per-unit matrices the dense rows give, whichever
    rows are chosen, in whatever order, however many rows a unit has."""
    dense = data.draw(hnp.arrays(np.float64, (rows, columns), elements=hs.sampled_from([0.0, 1.0, 0.1, -3.7, 1e12])))
    chosen = np.array(data.draw(hs.permutations(range(rows)))[: data.draw(hs.integers(0, rows))], dtype=np.int64)
    units = data.draw(hs.integers(1, 10))
    index = data.draw(hnp.arrays(np.int64, len(chosen), elements=hs.integers(0, units - 1)))
    cells = np.flatnonzero(dense.reshape(-1)).astype(np.int64)
    matrix = RowCells(cells, dense.reshape(-1)[cells], (rows, columns))
    expected = add_rows(np.zeros((units, columns)), index, dense[chosen])
    got = add_selected_rows(np.zeros((units, columns)), index, matrix, chosen)
    assert got.tobytes() == expected.tobytes()
    first = data.draw(hs.integers(0, rows))
    assert row_totals(head(matrix, first)).tobytes() == dense[:first].sum(axis=1).tobytes()
