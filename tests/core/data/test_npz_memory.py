"""A user's records held once (issue 46: a bounded run ends within 2 GB): reading ``--data``
or one party's file allocates the float32 features once plus a block of rows, not the
file's array, its train and test pieces and their concatenation (about 2.6 times the
features before), and hashing a partition gathers a block at a time."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fedlap_privacy.compute.allocator import tune_allocator
from fedlap_privacy.compute.mapped_tensors import mapped_empty
from fedlap_privacy.data import datasets as data_module
from fedlap_privacy.data.datasets import content_hash, partition_hash
from fedlap_privacy.data.user_data import load_records, load_user_data

N, D = 64_000, 256  # 65.5 MB of float32 features
BOUND = 1.3  # peak numpy allocations over the features' bytes


def _peak(call) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((N, D), dtype=np.float32)
    y = np.arange(N, dtype=np.int64) % 3
    client = (np.arange(N) * 7 % 5).astype(np.int64)  # clients interleaved in the file
    path = tmp_path_factory.mktemp("records") / "records.npz"
    np.savez(path, x=x, y=y, client=client)
    return path, x


def test_a_user_file_is_held_once_and_split_as_before(archive: tuple[Path, np.ndarray]) -> None:
    path, x = archive
    data, peak = _peak(lambda: load_user_data(path, seed=3))
    assert peak <= BOUND * x.nbytes, f"peak {peak / x.nbytes:.2f} x the features"
    # each client's records in file order, its held-out draw in the test set, as before
    client = np.arange(N) * 7 % 5
    rows_train, rows_test = [], []
    for k in range(5):
        rows = np.flatnonzero(client == k)
        held = np.zeros(len(rows), dtype=bool)
        held[np.random.default_rng([3, k, len(rows)]).choice(
            len(rows), round(0.2 * len(rows)), replace=False)] = True
        rows_train.append(rows[~held])
        rows_test.append(rows[held])
    train, test = np.concatenate(rows_train), np.concatenate(rows_test)
    np.testing.assert_array_equal(data.x_train, x[train])
    np.testing.assert_array_equal(data.y_train, train % 3)
    np.testing.assert_array_equal(data.x_test, x[test])
    np.testing.assert_array_equal(data.y_test, test % 3)
    assert [len(p) for p in data.partition] == [len(r) for r in rows_train]
    assert data.held_out


def test_a_fortran_order_file_is_held_once_and_equals_its_c_order_twin(
        tmp_path: Path, archive: tuple[Path, np.ndarray]) -> None:
    """``fortran_order: True`` (the file's author chooses) used to be read whole before the
    cast: about twice the features. Read a block of columns at a time, it is held once."""
    path, x = archive
    fortran = tmp_path / "fortran.npz"
    with np.load(path) as npz:
        np.savez(fortran, x=np.asfortranarray(x), y=npz["y"], client=npz["client"])
    data, peak = _peak(lambda: load_user_data(fortran, seed=3))
    assert peak <= BOUND * x.nbytes, f"peak {peak / x.nbytes:.2f} x the features"
    twin = load_user_data(path, seed=3)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(data, field), getattr(twin, field))


def test_one_partys_float64_file_is_held_once_as_float32(
        tmp_path: Path, archive: tuple[Path, np.ndarray]) -> None:
    _, x = archive
    path = tmp_path / "party.npz"
    np.savez(path, x=x.astype(np.float64), y=np.arange(N) % 3)  # cast a block at a time
    records, peak = _peak(lambda: load_records(path))
    assert peak <= BOUND * x.nbytes, f"peak {peak / x.nbytes:.2f} x the float32 features"
    np.testing.assert_array_equal(records.x, x)


def test_a_partition_hash_is_the_content_hash_of_its_rows(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1000, 3, 4), dtype=np.float32)
    y = rng.integers(0, 10, 1000)
    part = rng.permutation(1000)[:317]
    expected = content_hash(part, x[part], y[part])
    monkeypatch.setattr(data_module, "_HASH_BLOCK", 100)  # many blocks, one not full
    assert partition_hash(part, x, y) == expected
    assert content_hash(part, x[part], y[part]) == expected
    assert partition_hash(part[:0], x, y) == content_hash(part[:0], x[:0], y[:0])
    peak = _peak(lambda: content_hash(x))[1]
    assert peak < x.nbytes / 2  # hashed from the array's own memory, not a copy


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux /proc only")
def test_a_mapped_tensor_is_given_back_when_freed() -> None:
    """The tuned heap (fedlap_privacy.compute.allocator) keeps freed blocks; a client's gathered
    records come from their own mapping and leave with it."""
    tune_allocator()
    size = 96 << 20
    t = mapped_empty((size // 4,))
    t.fill_(1.0)
    before = _resident()
    del t
    assert before - _resident() > 0.9 * size
    assert mapped_empty((3, 4)).shape == (3, 4)  # small ones: the heap's
