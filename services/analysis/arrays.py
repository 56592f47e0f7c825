"""Grouped sums over numpy arrays, for the statistics' per-unit matrices.

``np.add.at`` is unbuffered and walks its indices one at a time in C with a generic inner loop: at a million
rows it took most of the statistics' time (docs/benchmarks.md, analysis at scale). ``np.bincount`` adds the same
values in the same order (so the same floating-point sums) an order of magnitude faster.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


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
