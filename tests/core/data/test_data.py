"""Datasets, file readers and client splits (docs/algorithms.md#splits), on miniature files
made here."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import shlex
import struct
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fedlap_privacy.data.client_splits import split_clients
from fedlap_privacy.data.dataset_files import (
    CHECKSUMS,
    CIFAR_ARCHIVE,
    CIFAR_TEST,
    CIFAR_TRAIN,
    MIRRORS,
)
from fedlap_privacy.data.datasets import load_dataset
from fedlap_privacy.errors import ConfigError, DataError

SHARED_FASHION = Path("/work/shared/data/fashion-mnist")


# ------------------------------------------------------------------ miniature files


def _idx_images(images: np.ndarray, magic: int = 2051) -> bytes:
    return struct.pack(">4i", magic, *images.shape) + images.astype(np.uint8).tobytes()


def _idx_labels(labels: np.ndarray, magic: int = 2049) -> bytes:
    return struct.pack(">2i", magic, len(labels)) + labels.astype(np.uint8).tobytes()


def _write(path: Path, content: bytes, gz: bool) -> None:
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(content)
    else:
        path.write_bytes(content)


def _mini_idx(folder: Path, gz: bool, n_train: int = 20, n_test: int = 10) -> dict:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n) % 10
        _write(folder / f"{prefix}-images-idx3-ubyte", _idx_images(images), gz)
        _write(folder / f"{prefix}-labels-idx1-ubyte", _idx_labels(labels), gz)
        arrays[prefix] = (images, labels)
    return arrays


class _Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 ``str`` (BINSTRING), as cPickle made CIFAR-10."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj: str | bytes) -> None:
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_py2_str


def _cifar_pickle(batch: dict, style: str = "py2") -> bytes:
    if style == "py2":  # the original files: Python 2 cPickle, protocol 2, numpy.core path
        buffer = io.BytesIO()
        _Py2Pickler(buffer, protocol=2).dump(batch)
        return buffer.getvalue().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    return pickle.dumps(batch, protocol=int(style))


def _cifar_batch(n: int, seed: int, str_keys: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"mini batch",
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [b"img_%d.png" % i for i in range(n)],
    }
    return {k.decode(): v for k, v in batch.items()} if str_keys else batch


def _mini_cifar(folder: Path, style: str = "py2", n: int = 4) -> dict[str, dict]:
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for i, name in enumerate((*CIFAR_TRAIN, CIFAR_TEST)):
        batch = _cifar_batch(n, seed=i, str_keys=(i % 2 == 1))
        (folder / name).write_bytes(_cifar_pickle(batch, style))
        batches[name] = batch
    return batches


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and fail) every attempt to open a URL."""
    calls: list[str] = []

    def urlopen(url, *args, **kwargs):
        calls.append(url)
        raise AssertionError(f"network used: {url}")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return calls


# ------------------------------------------------------------------------------ digits


def test_digits_shapes_normalisation_and_fixed_split() -> None:
    ds = load_dataset("digits")
    assert ds.x_train.shape == (1438, 1, 8, 8) and ds.x_test.shape == (359, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert (ds.in_channels, ds.image_size, ds.num_classes) == (1, 8, 10)
    assert ds.mean == (0.3053,) and ds.std == (0.3760,)
    pixels = np.concatenate([ds.x_train.ravel(), ds.x_test.ravel()])
    assert abs(pixels.mean()) < 1e-3 and abs(pixels.std() - 1) < 1e-3
    assert np.isclose(pixels.min(), -0.3053 / 0.3760, atol=1e-6)
    # stratified: every class holds 20% (rounded) of its records in the test set
    assert np.bincount(ds.y_test).tolist() == [36, 36, 35, 37, 36, 36, 36, 36, 35, 36]
    again = load_dataset("digits", data_dir="/nonexistent", download=False)
    assert np.array_equal(again.x_test, ds.x_test) and np.array_equal(again.y_train, ds.y_train)


def test_data_module_does_not_import_torch() -> None:
    code = "import sys, fedlap_privacy.data.datasets; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_unknown_dataset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'svhn'"):
        load_dataset("svhn")


# ------------------------------------------------------------------------ IDX (MNIST)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_idx_round_trip(tmp_path: Path, name: str, gz: bool, no_network: list[str]) -> None:
    arrays = _mini_idx(tmp_path, gz=gz)
    ds = load_dataset(name, tmp_path)
    mean, std = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}[name]
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.y_test.dtype == np.int64
    expected = (arrays["train"][0][:, None] / 255.0 - mean) / std
    np.testing.assert_allclose(ds.x_train, expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(ds.y_train, arrays["train"][1])
    assert np.array_equal(ds.y_test, arrays["t10k"][1])
    assert (ds.in_channels, ds.image_size) == (1, 28) and ds.mean == (mean,)
    assert no_network == []


def test_idx_prefers_an_existing_file_of_either_kind(tmp_path: Path) -> None:
    _mini_idx(tmp_path, gz=True)
    raw = tmp_path / "t10k-labels-idx1-ubyte"  # one file uncompressed, next to the rest
    raw.write_bytes(gzip.decompress((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    assert len(load_dataset("mnist", tmp_path).y_test) == 10


def _corrupt(folder: Path, stem: str, content: bytes, gz: bool) -> Path:
    for suffix in ("", ".gz"):
        (folder / f"{stem}{suffix}").unlink(missing_ok=True)
    _write(folder / stem, content, gz)
    return folder / (stem + (".gz" if gz else ""))


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize(
    ("stem", "content", "match"),
    [
        (
            "train-images-idx3-ubyte",
            _idx_images(np.zeros((20, 28, 28)), magic=2049),
            "bad magic number 2049",
        ),
        ("train-labels-idx1-ubyte", _idx_labels(np.zeros(20), magic=2051), "bad magic number 2051"),
        (
            "train-images-idx3-ubyte",
            _idx_images(np.zeros((20, 28, 28)))[:-100],
            "does not match its header",
        ),
        (
            "train-images-idx3-ubyte",
            _idx_images(np.zeros((20, 28, 28))) + b"\0",
            "does not match its header",
        ),
        ("train-images-idx3-ubyte", b"\0\0\x08", "truncated IDX header"),
        ("train-labels-idx1-ubyte", _idx_labels(np.zeros(19)), "19 labels for 20 images"),
        ("t10k-labels-idx1-ubyte", _idx_labels(np.full(10, 10)), "label 10 is out of range"),
        ("t10k-images-idx3-ubyte", _idx_images(np.zeros((10, 14, 14))), "expected 28x28"),
    ],
)
def test_corrupt_idx_files_name_the_file(
    tmp_path: Path, stem: str, content: bytes, match: str, gz: bool
) -> None:
    _mini_idx(tmp_path, gz=gz)
    bad = _corrupt(tmp_path, stem, content, gz)
    with pytest.raises(DataError, match=match) as info:
        load_dataset("mnist", tmp_path)
    assert str(bad) in str(info.value) or str(bad.with_suffix("")) in str(info.value)
    assert "\n" not in str(info.value)


def test_broken_gzip_is_a_data_error(tmp_path: Path) -> None:
    _mini_idx(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])  # truncated compressed stream
    with pytest.raises(DataError, match=str(path)):
        load_dataset("mnist", tmp_path)
    path.write_bytes(b"this is not gzip at all")
    with pytest.raises(DataError, match=f"cannot read {path}"):
        load_dataset("mnist", tmp_path)


def test_missing_idx_file_is_named(tmp_path: Path, no_network: list[str]) -> None:
    _mini_idx(tmp_path, gz=True)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"missing dataset file .*t10k-images-idx3-ubyte\.gz"):
        load_dataset("mnist", tmp_path)
    with pytest.raises(DataError, match="missing dataset file"):
        load_dataset("fashion-mnist", tmp_path / "empty")
    assert no_network == []


# ---------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("style", ["py2", "2", "4"])
@pytest.mark.parametrize("nested", [True, False])
def test_cifar_round_trip(tmp_path: Path, style: str, nested: bool) -> None:
    folder = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    batches = _mini_cifar(folder, style=style)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert (ds.in_channels, ds.image_size, ds.num_classes) == (3, 32, 10)
    first = batches["data_batch_1"]
    assert ds.y_train[:4].tolist() == first[b"labels"]
    mean = np.array([0.4914, 0.4822, 0.4465])[:, None, None]
    std = np.array([0.2023, 0.1994, 0.2010])[:, None, None]
    expected = (first[b"data"][0].reshape(3, 32, 32) / 255.0 - mean) / std
    np.testing.assert_allclose(ds.x_train[0], expected, rtol=1e-5, atol=1e-5)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64


class _RunsShell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Evals:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_cifar_pickle_is_refused_and_not_run(tmp_path: Path, protocol: int) -> None:
    _mini_cifar(tmp_path)
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_3"
    evil = {b"data": _RunsShell(f"touch {shlex.quote(str(marker))}"), b"labels": [0]}
    path.write_bytes(pickle.dumps(evil, protocol=protocol))
    with pytest.raises(DataError, match=f"refusing to load {path}: it references .*system"):
        load_dataset("cifar10", tmp_path)
    assert not marker.exists()
    path.write_bytes(pickle.dumps({b"data": _Evals()}, protocol=protocol))
    with pytest.raises(DataError, match=r"refusing to load .*builtin.*\.eval"):
        load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ([1, 2, 3], "not a dict"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8 array"),
        ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, "uint8 array"),
        ({b"data": np.zeros((10001, 3072), np.uint8), b"labels": [0] * 10001}, "uint8 array"),
        ({b"labels": [0, 1]}, "uint8 array"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "2 integers"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": ["a", "b"]}, "2 integers"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "label 10 is out"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [-1, 0]}, "label -1 is out"),
    ],
)
def test_invalid_cifar_batches_name_the_file(tmp_path: Path, batch: object, match: str) -> None:
    _mini_cifar(tmp_path)
    path = tmp_path / "test_batch"
    path.write_bytes(_cifar_pickle(batch))
    with pytest.raises(DataError, match=match) as info:
        load_dataset("cifar10", tmp_path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"", b"garbage that is not a pickle", b"\x80\x02}q\x00(U"])
def test_unreadable_cifar_file(tmp_path: Path, content: bytes) -> None:
    _mini_cifar(tmp_path)
    path = tmp_path / "data_batch_5"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"cannot read {path}"):
        load_dataset("cifar10", tmp_path)


def test_missing_cifar_file_is_named(tmp_path: Path, no_network: list[str]) -> None:
    _mini_cifar(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").unlink()
    with pytest.raises(DataError, match=r"missing dataset file .*data_batch_2"):
        load_dataset("cifar10", tmp_path)
    assert no_network == []


# ---------------------------------------------------------------------------- download


def _serve(monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes]) -> list[str]:
    """Answer urlopen from ``files`` (keyed by the URL's last component)."""
    calls: list[str] = []

    def urlopen(url, *args, **kwargs):
        calls.append(url)
        return io.BytesIO(files[url.rsplit("/", 1)[-1]])

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return calls


def test_download_verifies_checksums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _serve(monkeypatch, {name: b"not the real file" for name in CHECKSUMS["mnist"]})
    with pytest.raises(DataError, match=r"checksum mismatch for train-images-idx3-ubyte\.gz"):
        load_dataset("mnist", tmp_path / "mnist", download=True)
    assert calls == [MIRRORS["mnist"] + "train-images-idx3-ubyte.gz"]
    assert list((tmp_path / "mnist").iterdir()) == []  # neither the file nor a temp file


def test_download_network_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def urlopen(url, *args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(DataError, match=r"cannot download train-images-idx3-ubyte\.gz from http"):
        load_dataset("fashion-mnist", tmp_path, download=True)


def test_download_then_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "source"
    _mini_idx(source, gz=True)
    files = {p.name: p.read_bytes() for p in source.iterdir()}
    for name, content in files.items():
        monkeypatch.setitem(CHECKSUMS["mnist"], name, hashlib.md5(content).hexdigest())
    calls = _serve(monkeypatch, files)
    target = tmp_path / "target"
    (target).mkdir()
    (target / "t10k-labels-idx1-ubyte").write_bytes(  # present files are kept, not fetched
        gzip.decompress(files["t10k-labels-idx1-ubyte.gz"])
    )
    ds = load_dataset("mnist", target, download=True)
    assert len(ds.y_train) == 20 and len(ds.y_test) == 10
    assert len(calls) == 3 and not any("t10k-labels" in url for url in calls)
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [*(n for n in files if not n.startswith("t10k-labels")), "t10k-labels-idx1-ubyte"]
    )
    calls.clear()
    load_dataset("mnist", target, download=True)
    assert calls == []  # everything present: no network


def test_cifar_download_extracts_safely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "source"
    _mini_cifar(source / "cifar-10-batches-py")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for path in sorted((source / "cifar-10-batches-py").iterdir()):
            tar.add(path, arcname=f"cifar-10-batches-py/{path.name}")
        escape = tarfile.TarInfo("../escaped")  # hostile member: must not be written
        escape.size = 4
        tar.addfile(escape, io.BytesIO(b"evil"))
        link = tarfile.TarInfo("cifar-10-batches-py/batches.meta")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    content = archive.getvalue()
    monkeypatch.setitem(
        CHECKSUMS["cifar10"], CIFAR_ARCHIVE, hashlib.md5(content).hexdigest()
    )
    _serve(monkeypatch, {CIFAR_ARCHIVE: content})
    root = tmp_path / "root" / "cifar"
    ds = load_dataset("cifar10", root, download=True)
    assert ds.x_train.shape == (20, 3, 32, 32)
    assert not (tmp_path / "root" / "escaped").exists()
    assert sorted(p.name for p in (root / "cifar-10-batches-py").iterdir()) == sorted(
        [*CIFAR_TRAIN, CIFAR_TEST]
    )


def test_cifar_download_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _serve(monkeypatch, {CIFAR_ARCHIVE: b"truncated archive"})
    with pytest.raises(DataError, match=r"checksum mismatch for cifar-10-python.tar\.gz"):
        load_dataset("cifar10", tmp_path, download=True)
    assert list(tmp_path.iterdir()) == []


def test_published_checksums_are_well_formed() -> None:
    for files in CHECKSUMS.values():
        for md5 in files.values():
            assert len(md5) == 32 and int(md5, 16) >= 0
    assert len({md5 for files in CHECKSUMS.values() for md5 in files.values()}) == 9


# -------------------------------------------------------------------- shared benchmark data


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_FASHION.is_dir(), reason="shared Fashion-MNIST not present")
def test_shared_fashion_mnist(no_network: list[str]) -> None:
    ds = load_dataset("fashion-mnist", SHARED_FASHION)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    parts = split_clients(ds.y_train, 5)
    assert [len(p) for p in parts] == [12000] * 5
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(60000))
    assert no_network == []
