"""An ``x`` stored in Fortran order (``fortran_order: True``, chosen by the file's author)
is read a block of columns at a time (issue 46: a bounded run ends within 2 GB), not whole
before the cast, and gives exactly the arrays of the same values stored in C order: the
split, the scatter to train and test, and the refusal of values beyond float32."""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from npz_forge import npy_header, stored, write_zip

from fedlap_privacy.data import npz_reader
from fedlap_privacy.data.npz_reader import open_npz
from fedlap_privacy.data.user_data import load_records, load_user_data
from fedlap_privacy.errors import DataError

SHAPES = {"tabular": (7,), "gray": (1, 5, 6), "color": (3, 4, 5)}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 512 bytes: many blocks, columns split across blocks and runs of records."""
    monkeypatch.setattr(npz_reader, "_BLOCK", 512)


def _x(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape))  # float64


def _save(path: Path, x: np.ndarray, fortran: bool, **extra: np.ndarray) -> Path:
    layout = np.asfortranarray if fortran else np.ascontiguousarray
    np.savez(path, x=layout(x), **extra)
    return path


def _read(path: Path) -> np.ndarray:
    with np.load(path) as npz:
        return npz["x"]


@pytest.mark.parametrize("kind", SHAPES)
def test_a_fortran_file_with_clients_loads_as_its_c_order_twin(tmp_path: Path,
                                                                kind: str) -> None:
    n = 300  # 2,400 bytes of float64 per column: runs of records (512-byte blocks)
    x = _x(n, SHAPES[kind], 0)
    y, client = np.arange(n) % 3, np.arange(n) * 7 % 4
    loaded = {}
    for fortran in (False, True):
        path = _save(tmp_path / f"{fortran}.npz", x, fortran, y=y, client=client)
        assert np.isfortran(_read(path)) is fortran
        loaded[fortran] = load_user_data(path, seed=5)
    c, f = loaded[False], loaded[True]
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(f, field), getattr(c, field))
    assert f.x_train.dtype == np.float32 and f.x_train.flags.c_contiguous
    assert len(f.x_test) > 0 and not np.array_equal(c.x_train[:10], x[:10])  # a real scatter
    party = load_records(_save(tmp_path / "party.npz", x, True, y=y))
    np.testing.assert_array_equal(party.x, x.astype(np.float32))


@pytest.mark.parametrize("kind", SHAPES)
def test_a_folder_of_fortran_files_and_test_file_loads_as_c_order(tmp_path: Path,
                                                                  kind: str) -> None:
    """Whole columns per block (few records), with a test file: every file placed whole."""
    loaded = {}
    for fortran in (False, True):
        root = tmp_path / str(fortran)
        root.mkdir()
        for k in range(3):
            _save(root / f"site{k}.npz", _x(9 + k, SHAPES[kind], k), fortran,
                  y=np.arange(9 + k) % 2)
        _save(root / "test.npz", _x(11, SHAPES[kind], 9), fortran, y=np.arange(11) % 2)
        loaded[fortran] = load_user_data(root)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(loaded[True], field), getattr(loaded[False], field))
    assert loaded[True].partition is not None and not loaded[True].held_out


def test_read_columns_follows_the_fortran_bytes(tmp_path: Path) -> None:
    x = _x(50, (3, 4), 1)
    path = _save(tmp_path / "f.npz", x, True, y=np.zeros(50, np.int64))
    for block_bytes in (40, 400, 4000, 1 << 20):  # runs of 5 records .. the whole array
        got = np.full((50, 12), np.nan)
        with open_npz(path, ("x", "y")) as archive:
            assert archive.fortran("x") and not archive.fortran("y")
            sizes = []
            for block in archive.read_columns("x", block_bytes):
                p0, r0 = block.first_position, block.first_record
                rows, cols = block.values.shape
                got[r0:r0 + rows, p0:p0 + cols] = block.values
                sizes.append(block.values.nbytes)
        assert max(sizes) <= max(block_bytes, 50 * 8)
        np.testing.assert_array_equal(got, x.reshape(50, 12, order="F"))


@pytest.mark.parametrize("fortran", [False, True])
def test_beyond_float32_is_refused_naming_the_same_record(tmp_path: Path,
                                                           fortran: bool) -> None:
    """Record 5 is the first beyond float32 in file order, but its column comes after
    record 7's in Fortran order: both layouts name record 5."""
    x = _x(20, (3,), 2)
    x[7, 0], x[5, 2] = 3.5e38, -1e39
    path = _save(tmp_path / "site.npz", x, fortran, y=np.arange(20) % 2)
    for load in (load_records, load_user_data):
        with pytest.raises(DataError) as error:
            load(path)
        message = str(error.value)
        assert "\n" not in message and "record 5" in message and "float32" in message, message


def test_a_fortran_member_failing_its_crc_is_refused(tmp_path: Path) -> None:
    n, d = 40, 3
    body = bytearray(npy_header((n, d), "<f8", fortran=True) + _x(n, (d,), 3).tobytes("F"))
    crc = zlib.crc32(body)
    body[-100] ^= 0xFF  # the true CRC of other bytes
    y = stored("y.npy", npy_header((n,), "<i8") + np.zeros(n, np.int64).tobytes())
    path = write_zip(tmp_path / "crc.npz", [replace(stored("x.npy", bytes(body)), crc=crc), y])
    with pytest.raises(DataError) as error:
        load_records(path)
    assert "\n" not in str(error.value) and "crc.npz" in str(error.value)
