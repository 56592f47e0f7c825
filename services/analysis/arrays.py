"""Grouped sums over numpy arrays, for the statistics' per-unit matrices.

``np.add.at`` is unbuffered and walks its indices one at a time in C with a generic inner loop: at a million
rows it took most of the statistics' time (docs/benchmarks.md, analysis at scale). ``np.bincount`` adds the same
values in the same order (so the same floating-point sums) an order of magnitude faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class RowCells:
    """A rows-by-columns matrix held by its cells that may be nonzero: ``cells`` (``row * columns + column``,
    ascending, distinct) and their ``values``; every other cell is zero.

    The DuckDB engine's per-row, per-time-bucket sums: a unit row has calls in a few of the timeline's buckets,
    and ten million calls' 2.9 million rows held densely were some 3 GB for three metrics."""

    cells: npt.NDArray[np.int64]
    values: npt.NDArray[Any]
    shape: tuple[int, int]

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.values.dtype

    @classmethod
    def empty(cls, rows: int, columns: int, dtype: type) -> RowCells:
        return cls(np.zeros(0, np.int64), np.zeros(0, dtype), (rows, columns))


#: A per-row matrix either way: dense (the page reader's, grown as it reads) or by its cells (the DuckDB engine's).
RowMatrix = npt.NDArray[Any] | RowCells


def head(matrix: RowMatrix, rows: int) -> RowMatrix:
    """The first ``rows`` rows."""
    if not isinstance(matrix, RowCells):
        return matrix[:rows]
    if rows >= matrix.shape[0]:
        return matrix
    end = int(np.searchsorted(matrix.cells, rows * matrix.shape[1]))
    return RowCells(matrix.cells[:end], matrix.values[:end], (rows, matrix.shape[1]))


def row_totals(matrix: RowMatrix) -> FloatArray:
    """Each row's sum, in float64."""
    if not isinstance(matrix, RowCells):
        return np.asarray(matrix).sum(axis=1, dtype=np.float64)
    rows, columns = matrix.shape
    totals = np.bincount(matrix.cells // columns, weights=matrix.values.astype(np.float64), minlength=rows)
    return totals.astype(np.float64, copy=False)


def add_selected_rows(
    out: FloatArray, index: npt.NDArray[np.int64], matrix: RowMatrix, rows: npt.NDArray[np.int64]
) -> FloatArray:
    """``add_rows(out, index, matrix[rows])``: row ``rows[i]`` of ``matrix`` added to row ``index[i]`` of
    ``out``, in order. Of a :class:`RowCells` only its cells are read (no dense copy of the rows chosen); the
    sums are the same, as adding the other cells' zeros changes none."""
    if not isinstance(matrix, RowCells):
        return add_rows(out, index, matrix[rows])
    out += selected_row_sums(out.shape, index, matrix, rows)
    return out


def selected_row_sums(
    shape: tuple[int, int], index: npt.NDArray[np.int64], matrix: RowMatrix, rows: npt.NDArray[np.int64]
) -> FloatArray:
    """``add_selected_rows(np.zeros(shape), index, matrix, rows)``, the sums made in the array returned: no
    matrix of zeros beside them, which at a million units is 160 MB a matrix. Where nothing is added (an empty
    ``matrix``: a metric without positive calls), the zeros returned are untouched, so the system has not yet
    given them memory."""
    size, columns = shape
    if not isinstance(matrix, RowCells):
        return add_rows(np.zeros(shape), index, matrix[rows])
    if not len(index) or not len(matrix.cells):
        return np.zeros(shape)
    target = np.full(matrix.shape[0], -1, dtype=np.int64)
    target[rows] = index
    row_of = matrix.cells // columns
    at = target[row_of]
    chosen = at >= 0
    cells = at[chosen] * columns + matrix.cells[chosen] % columns
    weights = matrix.values[chosen].astype(np.float64)
    if len(rows) > 1 and not bool(np.all(rows[1:] > rows[:-1])):
        # Added in the order of ``rows``, as the dense rows would be: a unit's rows sum in the same order.
        position = np.zeros(matrix.shape[0], dtype=np.int64)
        position[rows] = np.arange(len(rows), dtype=np.int64)
        order = np.argsort(position[row_of[chosen]] * columns + matrix.cells[chosen] % columns, kind="stable")
        cells, weights = cells[order], weights[order]
    sums = np.bincount(cells, weights=weights, minlength=size * columns).astype(np.float64, copy=False)
    return sums.reshape(size, columns)


def add_rows(out: FloatArray, index: npt.NDArray[np.int64], values: npt.NDArray[np.generic]) -> FloatArray:
    """``np.add.at(out, index, values)`` for a float64 matrix ``out`` (rows by columns) and ``values`` of shape
    (len(index), columns): each row of ``values`` added to row ``index[i]`` of ``out``, in order."""
    rows, columns = out.shape
    if not len(index):
        return out
    cells = (index.astype(np.int64)[:, None] * columns + np.arange(columns, dtype=np.int64)).reshape(-1)
    weights = np.asarray(values, dtype=np.float64).reshape(-1)
    out += np.bincount(cells, weights=weights, minlength=rows * columns).reshape(rows, columns)
    return out


def dense_codes(labels: npt.NDArray[np.generic]) -> npt.NDArray[np.int64]:
    """``np.unique(labels, return_inverse=True)[1]``: each label's rank among the distinct labels. Small
    non-negative integers (unit rows) are ranked through a table instead of a sort."""
    labels = np.asarray(labels).reshape(-1)
    if (
        len(labels)
        and labels.dtype.kind in "iu"
        and int(labels.min()) >= 0
        and int(labels.max()) < 4 * len(labels) + 1024
    ):
        present = np.zeros(int(labels.max()) + 1, dtype=np.bool_)
        present[labels] = True
        rank = np.cumsum(present, dtype=np.int64) - 1
        return rank[labels]
    _, dense = np.unique(labels, return_inverse=True)
    return dense.reshape(-1).astype(np.int64)
