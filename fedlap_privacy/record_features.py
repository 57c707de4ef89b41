"""A file's features read as float32 into the arrays a run trains on, a block of rows at a
time (:meth:`fedlap_privacy.npz_reader.NpzArchive.read_rows`), so that reading ``--data``
holds the run's float32 features once plus one block, not the file's array, its float32
copy and the train and test pieces cut from it (docs/own-data.md#limits).

Every block is cast to float32, the training dtype, and only then checked for NaN and inf:
a float64 beyond float32's range (3.4e38) becomes inf in the cast (issue 46), and a block's
check needs a mask of the block, not of the whole array.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedlap_privacy.errors import DataError

__all__ = ["RowTargets", "check_finite", "read_features"]

_BLOCK_ROWS_BYTES = 4 << 20  # float32 bytes checked at once by check_finite


def check_finite(path: Path | str, x: np.ndarray, first: int = 0) -> None:
    """Refuse ``x`` (float32) if it holds NaN or inf, naming the record (``first``: the
    number of the first row of ``x`` in its file), checked in blocks of rows."""
    if x.ndim == 0 or len(x) == 0:
        return
    per = max(1, _BLOCK_ROWS_BYTES // max(x[0].nbytes, 1))
    for start in range(0, len(x), per):
        finite = np.isfinite(x[start:start + per])
        if not finite.all():
            bad = first + start + int(np.argwhere(~finite)[0][0])
            raise DataError(f"{path}: x holds NaN or inf (record {bad}) as float32, the "
                            "training dtype: remove or impute the NaN or infinite values "
                            "(float32 ends at +-3.4e38)")


def as_float32(block: np.ndarray) -> np.ndarray:
    """``block`` as float32 (itself if it is one already); beyond float32's range: inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        return block.astype(np.float32, copy=False)


@dataclass(frozen=True)
class RowTargets:
    """Where each row of one file goes: ``rows[r] >= 0`` is its place in the training array,
    ``rows[r] < 0`` is ``-1 - place`` in the test array. None: row r goes to place
    ``offset + r`` of ``train`` (a whole file, in order)."""

    rows: np.ndarray | None
    offset: int = 0

    def place(self, first: int, block: np.ndarray, train: np.ndarray,
              test: np.ndarray | None) -> None:
        """Rows ``first..first+len(block)-1`` of the file copied where they go."""
        if self.rows is None:
            train[self.offset + first:self.offset + first + len(block)] = block
            return
        to = self.rows[first:first + len(block)]
        kept = to >= 0
        if kept.all():
            train[to] = block
            return
        train[to[kept]] = block[kept]
        assert test is not None
        test[-1 - to[~kept]] = block[~kept]


def read_features(path: Path, blocks: Iterable[np.ndarray], targets: RowTargets,
                  train: np.ndarray, test: np.ndarray | None = None) -> None:
    """The file's ``x`` (``blocks`` of consecutive rows) cast to float32, checked finite
    (:func:`check_finite`) and copied into ``train`` / ``test`` as ``targets`` says."""
    first = 0
    for raw in blocks:
        block = as_float32(raw)
        check_finite(path, block, first)
        targets.place(first, block, train, test)
        first += len(block)
