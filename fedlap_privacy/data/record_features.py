"""A file's features read as float32 into the arrays a run trains on, a block of rows at a
time (:meth:`fedlap_privacy.data.npz_reader.NpzArchive.read_rows`), so that reading ``--data``
holds the run's float32 features once plus one block, not the file's array, its float32
copy and the train and test pieces cut from it (docs/own-data.md#limits). An array stored
in Fortran order (the file's author chooses) is read a block of columns at a time
(:meth:`~fedlap_privacy.data.npz_reader.NpzArchive.read_columns`) and each column scattered to
its place in the records: the same arrays as the same values stored in C order, within the
same memory.

Every block is cast to float32, the training dtype, and only then checked for NaN and inf:
a float64 beyond float32's range (3.4e38) becomes inf in the cast (issue 46), and a block's
check needs a mask of the block, not of the whole array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedlap_privacy.data.npz_reader import NpzArchive
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
            raise _not_finite(path, first + start + int(np.argwhere(~finite)[0][0]))


def _not_finite(path: Path | str, record: int) -> DataError:
    return DataError(f"{path}: x holds NaN or inf (record {record}) as float32, the training "
                     "dtype: remove or impute the NaN or infinite values (float32 ends at "
                     "+-3.4e38)")


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
              test: np.ndarray | None, columns: np.ndarray | None = None) -> None:
        """Rows ``first..first+len(block)-1`` of the file copied where they go; with
        ``columns``, ``block[:, j]`` goes to column ``columns[j]`` of the places' rows."""
        if self.rows is None:
            span = slice(self.offset + first, self.offset + first + len(block))
            train[span if columns is None else (span, columns)] = block
            return
        to = self.rows[first:first + len(block)]
        kept = to >= 0
        if kept.all():
            train[_at(to, columns)] = block
            return
        train[_at(to[kept], columns)] = block[kept]
        assert test is not None
        test[_at(-1 - to[~kept], columns)] = block[~kept]


def _at(rows: np.ndarray, columns: np.ndarray | None) -> np.ndarray | tuple[np.ndarray, ...]:
    return rows if columns is None else np.ix_(rows, columns)


def _c_positions(shape: tuple[int, ...], first: int, count: int) -> np.ndarray:
    """Where values ``first..first+count-1`` of a record of ``shape``, numbered in Fortran
    order, are in the record's C order."""
    fortran = np.arange(first, first + count)
    if not shape:
        return fortran
    return np.ravel_multi_index(np.unravel_index(fortran, shape, order="F"), shape)


def read_features(archive: NpzArchive, targets: RowTargets, train: np.ndarray,
                  test: np.ndarray | None = None, name: str = "x") -> None:
    """The archive's ``x`` cast to float32 a block at a time, checked finite
    (:func:`check_finite`) and copied into ``train`` / ``test`` as ``targets`` says: blocks
    of rows, or of columns for an array stored in Fortran order (:func:`_read_columns`)."""
    if archive.fortran(name) and archive.headers[name].shape:
        _read_columns(archive, name, targets, train, test)
        return
    first = 0
    for raw in archive.read_rows(name):
        block = as_float32(raw)
        check_finite(archive.path, block, first)
        targets.place(first, block, train, test)
        first += len(block)


def _read_columns(archive: NpzArchive, name: str, targets: RowTargets, train: np.ndarray,
                  test: np.ndarray | None) -> None:
    """A Fortran-order ``x`` (:meth:`~fedlap_privacy.data.npz_reader.NpzArchive.read_columns`)
    scattered into the records' C-order values. A block holding NaN or inf is not placed,
    and the whole array is checked before the first such record is named: the refusal
    names the record that rows read in order would."""
    shape = train.shape[1:]
    positions = math.prod(shape)
    flat_train = train.reshape(len(train), positions)
    flat_test = None if test is None else test.reshape(len(test), positions)
    bad: int | None = None
    for block in archive.read_columns(name):
        values = as_float32(block.values)
        rows_finite = np.isfinite(values).all(axis=1)
        if not rows_finite.all():
            record = block.first_record + int(np.flatnonzero(~rows_finite)[0])
            bad = record if bad is None else min(bad, record)
            continue
        if bad is None:
            columns = _c_positions(shape, block.first_position, values.shape[1])
            targets.place(block.first_record, values, flat_train, flat_test, columns)
    if bad is not None:
        raise _not_finite(archive.path, bad)
