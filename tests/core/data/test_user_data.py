"""``--data``'s formats (fedlap_privacy.data.user_data): natural partitions, held-out tests, every
refusal as one DataError line naming the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from user_records import CLASSES, FEATURES, blobs, tabular_folder

from fedlap_privacy.data.datasets import CUSTOM
from fedlap_privacy.data.user_data import HOLDOUT_FRACTION, load_records, load_user_data, probe
from fedlap_privacy.errors import DataError


def test_folder_is_the_natural_partition_in_file_order(tmp_path: Path) -> None:
    root = tabular_folder(tmp_path / "d", sizes=(30, 20, 10))
    data = load_user_data(root)
    assert data.name == CUSTOM and data.is_tabular and data.input_shape == (FEATURES,)
    assert data.num_classes == CLASSES and not data.held_out
    assert [len(p) for p in data.partition] == [30, 20, 10]
    x1, _ = blobs(20, 1)  # site1.npz is the second client, its records untouched
    np.testing.assert_array_equal(data.x_train[data.partition[1]], x1)
    assert len(data.y_test) == 60


def test_without_test_file_each_client_holds_out_a_seeded_fifth(tmp_path: Path) -> None:
    root = tabular_folder(tmp_path / "d", sizes=(50, 40), test=0)
    a, b = load_user_data(root, seed=3), load_user_data(root, seed=3)
    assert a.held_out and [len(p) for p in a.partition] == [40, 32]
    assert len(a.y_test) == round(HOLDOUT_FRACTION * 50) + round(HOLDOUT_FRACTION * 40)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert not np.array_equal(load_user_data(root, seed=4).x_test, a.x_test)
    # held-out records are not training records
    rows = {r.tobytes() for r in a.x_train}
    assert not any(r.tobytes() in rows for r in a.x_test)


def test_single_file_with_client_ids_and_without(tmp_path: Path) -> None:
    x, y = blobs(100, 0)
    client = np.repeat([0, 1, 2, 3], 25)
    np.savez(tmp_path / "all.npz", x=x, y=y, client=client)
    data = load_user_data(tmp_path / "all.npz")
    assert len(data.partition) == 4 and data.held_out
    np.savez(tmp_path / "flat.npz", x=x, y=y)
    flat = load_user_data(tmp_path / "flat.npz")
    assert flat.partition is None and len(flat.y_train) + len(flat.y_test) == 100


def test_images_keep_their_shape(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for k in range(2):
        np.savez(tmp_path / f"c{k}.npz", x=rng.normal(size=(12, 1, 8, 8)).astype(np.float32),
                 y=np.arange(12) % 4)
    data = load_user_data(tmp_path)
    assert data.input_shape == (1, 8, 8) and not data.is_tabular and data.num_classes == 4


def _case(tmp_path: Path, name: str) -> Path:
    """One bad data set per refusal (see test_each_bad_input_is_one_line)."""
    root = tabular_folder(tmp_path / name, sizes=(20, 20), test=0)
    x, y = blobs(20, 5)
    if name == "features":
        np.savez(root / "site1.npz", x=np.hstack([x, x[:, :1]]), y=y)
    elif name == "dtype":
        np.savez(root / "site1.npz", x=x.astype(np.float64), y=y)
    elif name == "nan":
        x[7, 2] = np.nan
        np.savez(root / "site1.npz", x=x, y=y)
    elif name == "inf":
        x[3, 0] = np.inf
        np.savez(root / "site1.npz", x=x, y=y)
    elif name == "negative":
        y[0] = -1
        np.savez(root / "site1.npz", x=x, y=y)
    elif name == "range":
        np.savez(root / "site0.npz", x=x, y=y, num_classes=3)
        np.savez(root / "site1.npz", x=x, y=np.where(y == 2, 5, y), num_classes=3)
    elif name == "labels":
        np.savez(root / "site0.npz", x=x, y=y, num_classes=3)
        np.savez(root / "site1.npz", x=x, y=y, num_classes=4)
    elif name == "test-label":
        np.savez(root / "test.npz", x=x, y=np.full(20, 7))
    elif name == "empty":
        np.savez(root / "site1.npz", x=x[:0], y=y[:0])
    elif name == "images":
        np.savez(root / "site1.npz", x=np.zeros((20, 1, 2, 3), np.float32), y=y)
    elif name == "pickle":
        np.savez(root / "site1.npz", x=np.array([object()] * 20, dtype=object), y=y)
    elif name == "no-y":
        np.savez(root / "site1.npz", x=x)
    elif name == "no-npz":
        for f in root.iterdir():
            f.unlink()
        (root / "notes.txt").write_text("x")
    elif name == "gap":
        np.savez(root / "all.npz", x=x, y=y, client=np.where(np.arange(20) < 10, 0, 2))
        return root / "all.npz"
    return root


BAD = {
    "features": "7 features", "dtype": "float64", "nan": "NaN or inf (record 7)",
    "inf": "NaN or inf (record 3)", "negative": "label -1", "range": "label 5 is out of range",
    "labels": "label sets disagree", "test-label": "label 7 is not among", "empty":
    "empty client", "images": "images 1x2x3", "pickle": "Python objects", "no-y": "missing y",
    "no-npz": "no client .npz", "gap": "id 1 has no records",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_bad_input_is_one_line(tmp_path: Path, name: str) -> None:
    with pytest.raises(DataError) as info:
        load_user_data(_case(tmp_path, name))
    message = str(info.value)
    assert BAD[name] in message and "\n" not in message


def test_probe_reads_no_features(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout and labels come from headers and y alone: x is never loaded."""
    root = tabular_folder(tmp_path / "d")
    from fedlap_privacy.data.npz_reader import NpzArchive

    read = []
    real = NpzArchive.read
    monkeypatch.setattr(NpzArchive, "read", lambda a, n: read.append(n) or real(a, n))
    layout = probe(root)
    assert layout.input_shape == (FEATURES,) and layout.num_classes == CLASSES
    assert "x" not in read and layout.natural and len(layout.clients) == 3


def test_idx_records_are_read_by_the_same_reader(tmp_path: Path) -> None:
    """audit's IDX pair goes through load_records too: scaled to [0, 1], normalised when
    asked, and under the same checks (a label count that disagrees is one line)."""
    images = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 14
    (tmp_path / "img").write_bytes(struct.pack(">IIII", 2051, 2, 3, 3) + images.tobytes())
    (tmp_path / "lab").write_bytes(struct.pack(">II", 2049, 2) + bytes([1, 0]))
    (tmp_path / "one").write_bytes(struct.pack(">II", 2049, 1) + bytes([1]))
    records = load_records(f"{tmp_path / 'img'},{tmp_path / 'lab'}", normalise=(0.5, 0.25))
    assert records.x.shape == (2, 1, 3, 3) and records.x.dtype == np.float32
    np.testing.assert_allclose(records.x[:, 0], (images / 255.0 - 0.5) / 0.25, rtol=1e-6)
    assert records.y.tolist() == [1, 0] and records.y.dtype == np.int64
    with pytest.raises(DataError, match=r"y must hold one integer label per record of x \(2\)"):
        load_records(f"{tmp_path / 'img'},{tmp_path / 'one'}")


def test_one_partys_records_a_flower_nodes_data_file(tmp_path: Path) -> None:
    """load_records: one file under the same checks, as float32 / int64; one class is fine
    (a node may hold one); a client array or a label beyond num_classes is one line."""
    x, _ = blobs(12, 1)
    path = tmp_path / "node.npz"
    np.savez(path, x=x.astype(np.float64), y=np.ones(12, dtype=np.uint8), num_classes=CLASSES)
    records = load_records(path)
    assert records.x.dtype == np.float32 and records.y.dtype == np.int64
    assert records.input_shape == (FEATURES,) and records.declared_classes == CLASSES
    np.savez(path, x=x, y=np.ones(12, dtype=np.int64), client=np.zeros(12, dtype=np.int64))
    with pytest.raises(DataError, match=r"a node's data file holds its own records only$"):
        load_records(path)
    np.savez(path, x=x, y=np.full(12, CLASSES), num_classes=CLASSES)
    with pytest.raises(DataError, match=rf"label {CLASSES} is out of range 0..{CLASSES - 1}$"):
        load_records(path)


def test_thousands_of_natural_clients_in_one_file_keep_their_records(tmp_path: Path) -> None:
    from fedlap_privacy.fl.config import TrainConfig
    from fedlap_privacy.fl.engine.simulation import client_parts

    rng = np.random.default_rng(0)
    ids = rng.permutation(np.repeat(np.arange(3000), 8))  # 3,000 clients of 8, interleaved
    x = np.stack([ids, np.arange(len(ids))], axis=1).astype(np.float32)  # (client, row)
    y = (ids % CLASSES).astype(np.int64)
    np.savez(tmp_path / "all.npz", x=x, y=y, client=ids)
    data = load_user_data(tmp_path / "all.npz")
    assert len(data.partition) == 3000 and data.held_out
    for k in (0, 1234, 2999):
        rows = data.x_train[data.partition[k]]
        assert (rows[:, 0] == k).all() and len(rows) == 8 - round(HOLDOUT_FRACTION * 8)
        assert np.all(np.diff(rows[:, 1]) > 0)  # in file order
    cfg = TrainConfig(method="fedavg", dataset=CUSTOM, data=str(tmp_path / "all.npz"),
                      clients=3000, validation_records=600, split_seed=0)
    parts = client_parts(cfg, data)
    assert sum(len(p) for p in parts) == len(data.y_train) - 600
    assert all(set(data.x_train[p, 0].tolist()) <= {float(k)} for k, p in enumerate(parts))
    with pytest.raises(Exception, match=r"^client \d+ holds no records once the 17000 "):
        client_parts(cfg.__class__(**{**cfg.to_dict(), "validation_records": 17000}), data)
