"""The built-in datasets and their normalisation (docs/algorithms.md#model-and-data).

Four image datasets, all returned as float32 ``(N, C, H, W)`` arrays normalised with fixed
per-channel mean/std constants (never computed from the data at run time):

* ``digits`` -- scikit-learn's bundled 8x8 digits; a fixed stratified 80/20 split.
* ``mnist``, ``fashion-mnist`` -- the standard IDX files (gzipped or not) in ``data_dir``.
* ``cifar10`` -- the CIFAR-10 "python version" batches, read without running the pickles.

The files are read, validated and (with ``download=True`` only) fetched by
:mod:`fedlap_privacy.data.dataset_files`; the splits of the training records over the clients
are :mod:`fedlap_privacy.data.client_splits`'. Every problem is a :class:`DataError` naming the
file, or a :class:`ConfigError` naming the bad argument.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.data.dataset_files import (
    CIFAR_TEST,
    CIFAR_TRAIN,
    IDX_FILES,
    IDX_IMAGE_MAGIC,
    IDX_LABEL_MAGIC,
    cifar_folder,
    idx_path,
    read_cifar_batch,
    read_idx,
)
from fedlap_privacy.errors import ConfigError, DataError

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10")
#: the dataset name of a run on a user's own records (``--data``, :mod:`.user_data`)
CUSTOM = "custom"
#: the standard training-set sizes (digits: the fixed 80% split of _load_digits below)
TRAIN_RECORDS = {"digits": 1438, "mnist": 60_000, "fashion-mnist": 60_000, "cifar10": 50_000}
SPLITS = ("noniid", "iid", "dirichlet", "shards", "label-dirichlet")
PAPER_CLASS_ORDER = (5, 6, 1, 2, 0, 8, 9, 3, 4, 7)
NUM_CLASSES = 10

# Normalisation constants (mean, std) per channel. Digits: computed once from all 1797
# bundled images scaled to [0, 1] (mean 0.30526, std 0.37605) and fixed here.
NORMALISATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "digits": ((0.3053,), (0.3760,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
}
#: the published class counts (train, test) of the downloaded datasets: a dry run plans a
#: run whose files are not yet downloaded on them (:func:`standard_stand_in`)
CLASS_COUNTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "mnist": ((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
              (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)),
    "fashion-mnist": ((6000,) * 10, (1000,) * 10),
    "cifar10": ((5000,) * 10, (1000,) * 10),
}
RECORD_SHAPES = {"mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
DIGITS_SPLIT_SEED = 0  # numpy RandomState seed of the fixed stratified digits split
DIGITS_TEST_FRACTION = 0.2


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of float32 inputs and int64 labels: normalised images
    ``(N, C, H, W)`` (the built-in datasets and a user's images) or feature rows ``(N, D)``
    (a user's tabular data, :mod:`fedlap_privacy.data.user_data`).

    ``partition``: the natural split of ``x_train`` over the clients (index arrays, one per
    client, as the user's files hold the records) or None (the run's split decides).
    ``held_out``: the test records were held out of the clients' own records (no separate
    test set), so evaluating on them is a release about private data.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    partition: tuple[np.ndarray, ...] | None = None
    held_out: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one record: ``(C, H, W)`` or ``(D,)``."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def is_tabular(self) -> bool:
        """Feature rows ``(N, D)`` rather than images."""
        return self.x_train.ndim == 2

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        height, width = self.x_train.shape[2:]
        assert height == width, f"{self.name}: images are {height}x{width}, not square"
        return int(height)


_HASH_BLOCK = 16 << 20  # bytes hashed (or gathered for hashing) at once


def _hash_array(digest: Any, a: np.ndarray) -> None:
    """``a``'s dtype, shape and C-order bytes into ``digest``, from its own memory (no copy
    of a C-contiguous array), in blocks."""
    a = np.ascontiguousarray(a)
    digest.update(f"{a.dtype.str}{a.shape}".encode())
    flat = a.reshape(-1).view(np.uint8)
    for start in range(0, len(flat), _HASH_BLOCK):
        digest.update(flat[start:start + _HASH_BLOCK])


def content_hash(*arrays: np.ndarray) -> str:
    """SHA-256 of arrays' dtypes, shapes and bytes: pins the exact records a run used."""
    digest = hashlib.sha256()
    for a in arrays:
        _hash_array(digest, a)
    return digest.hexdigest()


def partition_hash(index: np.ndarray, *arrays: np.ndarray) -> str:
    """``content_hash(index, *(a[index] for a in arrays))``, the same digest, gathering a
    block of the indexed rows at a time rather than a copy of every client's records."""
    digest = hashlib.sha256()
    _hash_array(digest, index)
    for a in arrays:
        shape = (len(index), *a.shape[1:])
        digest.update(f"{a.dtype.str}{shape}".encode())
        per = max(1, _HASH_BLOCK // max(a[:1].nbytes, 1))
        for start in range(0, len(index), per):
            rows = np.ascontiguousarray(a[index[start:start + per]])
            digest.update(rows.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool = False) -> Dataset:
    """Load one of :data:`DATASETS`, normalised as in docs/algorithms.md#normalisation.

    ``data_dir`` is the folder holding the files (for CIFAR-10 it may hold them directly or
    in ``cifar-10-batches-py/``); it defaults to ``data/<name>`` and is ignored for
    ``digits``. With ``download=True`` missing files are fetched and MD5-verified.
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        return _load_digits()
    root = dataset_root(name, data_dir)
    if name == "cifar10":
        return _load_cifar10(root, download)
    return _load_idx_dataset(name, root, download)


def dataset_root(name: str, data_dir: str | Path | None = None) -> Path:
    """The folder of a built-in dataset's files: ``data_dir``, else ``data/<name>``."""
    return Path(data_dir) if data_dir is not None else Path("data") / name


def standard_stand_in(name: str) -> Dataset:
    """A stand-in for a downloadable dataset not yet on disk: its standard sizes, record
    shape and class counts (labels in a fixed shuffled order), every image zero (a
    read-only view, no memory). What a dry run splits and times in place of the files."""
    if name not in CLASS_COUNTS:
        raise ConfigError(f"no standard sizes for dataset {name!r}")
    rng = np.random.default_rng(0)
    train, test = (rng.permutation(np.repeat(np.arange(NUM_CLASSES), counts)).astype(np.int64)
                   for counts in CLASS_COUNTS[name])
    zero = np.zeros((1, *RECORD_SHAPES[name]), dtype=np.float32)
    mean, std = NORMALISATION[name]
    return Dataset(name, np.broadcast_to(zero, (len(train), *zero.shape[1:])), train,
                   np.broadcast_to(zero, (len(test), *zero.shape[1:])), test, NUM_CLASSES,
                   mean, std)


# ----------------------------------------------------------------------------- digits


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits  # lazy: scikit-learn is slow to import

    bunch = load_digits()
    x = bunch.data.reshape(-1, 1, 8, 8)  # values 0..16
    y = bunch.target.astype(np.int64)
    # Stratified: per class, a RandomState permutation (a stream numpy keeps stable) puts
    # round(20%) of the records in the test set -> 1438 train / 359 test, always the same.
    rng = np.random.RandomState(DIGITS_SPLIT_SEED)
    test = []
    for c in range(NUM_CLASSES):
        members = np.flatnonzero(y == c)
        test.append(rng.permutation(members)[: round(DIGITS_TEST_FRACTION * len(members))])
    is_test = np.zeros(len(y), dtype=bool)
    is_test[np.concatenate(test)] = True
    return _make_dataset("digits", x[~is_test], y[~is_test], x[is_test], y[is_test], 16.0)


def _make_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    max_value: float = 255.0,
) -> Dataset:
    """Scale raw pixels to [0, 1] and normalise them with the fixed constants of ``name``."""
    mean, std = NORMALISATION[name]
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)

    def normalise(x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float32)  # one float copy, then in place (CIFAR-10 is 600 MB)
        out /= np.float32(max_value)
        out -= m
        out /= s
        return out

    return Dataset(
        name=name,
        x_train=normalise(x_train),
        y_train=y_train.astype(np.int64),
        x_test=normalise(x_test),
        y_test=y_test.astype(np.int64),
        num_classes=NUM_CLASSES,
        mean=mean,
        std=std,
    )


# -------------------------------------------------------------------- MNIST (IDX files)


def _load_idx_dataset(name: str, root: Path, download: bool) -> Dataset:
    paths = [idx_path(name, root, stem, download) for stem in IDX_FILES]
    arrays = []
    for images, labels in (paths[:2], paths[2:]):
        x = read_idx(images, IDX_IMAGE_MAGIC, ndim=3)
        y = read_idx(labels, IDX_LABEL_MAGIC, ndim=1)
        if x.shape[1:] != (28, 28):
            raise DataError(f"{images}: images are {x.shape[1]}x{x.shape[2]}, expected 28x28")
        if len(x) != len(y):
            raise DataError(f"{labels}: {len(y)} labels for {len(x)} images in {images}")
        if y.max() >= NUM_CLASSES:
            raise DataError(f"{labels}: label {int(y.max())} is out of range 0..9")
        arrays += [x.reshape(-1, 1, 28, 28), y]
    return _make_dataset(name, *arrays)




# ---------------------------------------------------------------------------- CIFAR-10


def _load_cifar10(root: Path, download: bool) -> Dataset:
    folder = cifar_folder(root, download)
    train = [read_cifar_batch(folder / name, NUM_CLASSES) for name in CIFAR_TRAIN]
    x_test, y_test = read_cifar_batch(folder / CIFAR_TEST, NUM_CLASSES)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    return _make_dataset("cifar10", x_train, y_train, x_test, y_test)
