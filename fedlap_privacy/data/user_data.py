"""A user's own records as a run's dataset: ``train --data PATH`` (docs/own-data.md).

Two layouts, both ``.npz`` archives read with ``allow_pickle=False`` (no pickle, no code):

* a FOLDER of ``.npz`` files, one per client (sorted file names give the client order), each
  with arrays ``x`` and ``y``, plus an optional ``test.npz`` used only for evaluation. This
  is the natural partition: each site keeps its own records, nothing is re-split.
* ONE ``.npz`` with ``x``, ``y`` and optionally ``client`` (an integer per record, clients
  ``0..K-1``: the natural partition). Without ``client`` the run's ``split`` / ``clients``
  cut it as they cut a built-in dataset.

``x`` holds images ``(N, C, H, W)`` or feature rows ``(N, D)`` (tabular), numbers of one
dtype in every file, used as they are (as float32; normalise them yourself, with constants
that do not come from the private records). ``y`` holds integer labels ``0..K-1``. Every
file may carry a 0-d ``num_classes``; they must agree, and the labels must lie below it
(without it, K is one more than the largest client label).

Without a test set, :data:`HOLDOUT_FRACTION` of each client's records (a seeded draw, per
client, from the run's seed) is held out of training and used for the per-round test
accuracy, so that accuracy is computed from private records: the run declares it public
(:data:`HELD_OUT_NOTE`), it is not covered by epsilon.

Every archive is read by :mod:`fedlap_privacy.data.npz_reader` (forged files: links, duplicate
or unexpected members, zip bombs, non-numeric dtypes), under :class:`~fedlap_privacy.
npz_reader.NpzLimits`. Checks here, each one :class:`~fedlap_privacy.errors.DataError` line
naming the file: a folder without client ``.npz`` files, missing arrays, records beyond the
limits (features, image size and channels, records, classes, clients, float32 bytes), clients
(or the test set) that disagree on the feature count, image shape or dtype of ``x``,
disagreeing ``num_classes``, a test label the clients' classes do not cover, labels out of
range, an empty client, NaN or inf in ``x`` once cast to float32. :func:`probe` reads the
archives' array headers and the labels only, so that the run can refuse a bad layout (or a
model, :mod:`fedlap_privacy.model_factory`, built only for a layout within the limits)
before any record's features are read; :func:`load_user_data` then reads each file again,
once, and checks everything (a file changed since the probe is refused).
:func:`load_records` reads ONE party's file under the same checks (a Flower node's
``data-file``, audit's ``--members`` / ``--nonmembers``): the package's one reader of a
file of records. :func:`load_run_data` reads a saved run's dataset again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.data.dataset_files import read_idx_records
from fedlap_privacy.data.datasets import CUSTOM, Dataset, load_dataset
from fedlap_privacy.data.npz_reader import (
    LIMITS,
    NpyHeader,
    NpzArchive,
    NpzLimits,
    folder_entries,
    open_npz,
)
from fedlap_privacy.data.record_features import RowTargets, check_finite, read_features
from fedlap_privacy.errors import DataError

__all__ = ["HELD_OUT_NOTE", "HOLDOUT_FRACTION", "RECORD_ARRAYS", "TEST_FILE", "DataLayout",
           "NpyHeader", "Records", "describe_shape", "held_out_count", "load_records",
           "load_run_data", "load_user_data", "probe", "record_headers"]

TEST_FILE = "test.npz"
#: the arrays a file of records may hold (any other member is refused)
RECORD_ARRAYS = ("x", "y", "num_classes", "client")
#: share of each client's records held out for evaluation when there is no test set
HOLDOUT_FRACTION = 0.2
#: what a run without a test set declares public (its accuracy is measured on private records)
HELD_OUT_NOTE = ("the test accuracy and loss of every round, measured on records held out of "
                 "the clients' own data (no test.npz): not covered by epsilon")


@dataclass(frozen=True)
class DataLayout:
    """A user's data as its headers and labels describe it (:func:`probe`)."""

    path: Path
    clients: tuple[Path, ...]  # one file per client (a folder), or the single file
    test: Path | None
    input_shape: tuple[int, ...]
    num_classes: int
    natural: bool  # the records come partitioned (a folder, or a ``client`` array)
    sizes: tuple[int, ...]  # records per client as the files hold them (one entry: not split)

    @property
    def tabular(self) -> bool:
        return len(self.input_shape) == 1

    @property
    def folder(self) -> Path | None:
        """The ``--data`` folder its files are entries of, None for a single file."""
        return None if self.clients == (self.path,) else self.path

    def training_records(self) -> int:
        """How many records the clients train on: all of them with a test set, else what
        the held-out share leaves (:func:`held_out_count`)."""
        if self.test is not None:
            return sum(self.sizes)
        return sum(n - held_out_count(n) for n in self.sizes)


@dataclass(frozen=True, eq=False)
class Records:
    """One party's records, read and checked (:func:`load_records`)."""

    path: Path
    x: np.ndarray  # float32 (N, *input_shape)
    y: np.ndarray  # int64 labels
    declared_classes: int | None  # the file's num_classes, if it declares one

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


@dataclass(frozen=True)
class _FileFacts:
    """What one file's headers and small arrays say (:func:`_probe_file`)."""

    x: NpyHeader
    top: int  # its largest label
    declared: int | None  # its num_classes
    client_sizes: tuple[int, ...] | None  # records per id of its ``client`` array


def _records_archive(path: Path, folder: Path | None, limits: NpzLimits) -> NpzArchive:
    """A file of records opened by the one reader (:mod:`fedlap_privacy.data.npz_reader`)."""
    return open_npz(path, RECORD_ARRAYS, ("x", "y"), folder, limits)


def _check_x(path: Path | str, header: NpyHeader, limits: NpzLimits) -> None:
    """The shape and dtype of ``x`` from its header, within ``limits`` (docs/own-data.md)."""
    shape = header.shape
    if len(shape) not in (2, 4):
        raise DataError(f"{path}: x has shape {shape}; expected images (N, C, H, W) "
                        "or feature rows (N, D)")
    if header.dtype.kind not in "fiu":
        raise DataError(f"{path}: x has dtype {header.dtype}; expected numbers")
    if shape[0] == 0:
        raise DataError(f"{path}: an empty client (x has no records)")
    if 0 in shape[1:]:
        raise DataError(f"{path}: x has shape {shape}; a record cannot be empty")
    where = "(docs/own-data.md#limits)"
    if shape[0] > limits.records:
        raise DataError(f"{path}: x holds {shape[0]:,} records, more than the "
                        f"{limits.records:,} one file may hold {where}")
    if len(shape) == 2 and shape[1] > limits.features:
        raise DataError(f"{path}: x has {shape[1]:,} features, more than the "
                        f"{limits.features:,} a record may have {where}")
    if len(shape) == 4 and shape[1] > limits.channels:
        raise DataError(f"{path}: x has images of {shape[1]:,} channels, more than the "
                        f"{limits.channels} an image may have {where}")
    if len(shape) == 4 and max(shape[2:]) > limits.image_side:
        raise DataError(f"{path}: x has images {shape[2]}x{shape[3]}, larger than "
                        f"{limits.image_side}x{limits.image_side} {where}")


def _feature_bytes(headers: list[NpyHeader]) -> int:
    """The bytes the features of ``headers`` take as float32 (the training dtype)."""
    return sum(math.prod(h.shape) for h in headers) * 4


def _check_data_bytes(path: Path, headers: list[NpyHeader], limits: NpzLimits) -> None:
    if (size := _feature_bytes(headers)) > limits.data_bytes:
        raise DataError(f"{path}: the features take {size:,} bytes as float32, more than the "
                        f"{limits.data_bytes:,} a run reads (docs/own-data.md#limits)")


def _records_header(path: Path, members: dict[str, NpyHeader], limits: NpzLimits) -> NpyHeader:
    """The header of ``x`` in a file of records, checked (arrays ``x`` and ``y`` present)."""
    missing = [a for a in ("x", "y") if a not in members]
    if missing:
        raise DataError(f"{path}: an .npz of records needs arrays 'x' and 'y' "
                        f"(missing {', '.join(missing)})")
    header = members["x"]
    _check_x(path, header, limits)
    return header


def record_headers(path: Path, limits: NpzLimits = LIMITS) -> dict[str, NpyHeader]:
    """The headers of a file of records, checked as :func:`load_records` checks them before
    it reads anything (``audit --dry-run``)."""
    with _records_archive(path, None, limits) as archive:
        headers = archive.headers
    _records_header(path, headers, limits)
    return headers


def _labels(path: Path, archive: NpzArchive, records: int, limits: NpzLimits) -> np.ndarray:
    header = archive.headers["y"]
    return _checked_labels(path, header, records, lambda: archive.read("y"), limits)


def _checked_labels(path: Path | str, header: NpyHeader, records: int,
                    read: Callable[[], np.ndarray], limits: NpzLimits) -> np.ndarray:
    """The labels ``read()`` returns, once ``header`` says one integer per record; in
    ``0..limits.classes - 1``."""
    if header.shape != (records,) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: y must hold one integer label per record of x ({records}), "
                        f"found {header.dtype} {header.shape}")
    y = read().astype(np.int64)
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: label {int(y.min())} is out of range (labels are 0..K-1)")
    if len(y) and y.max() >= limits.classes:
        raise DataError(f"{path}: label {int(y.max()):,} asks for more than the "
                        f"{limits.classes:,} classes a run may have (docs/own-data.md#limits)")
    return y


def _declared_classes(path: Path, archive: NpzArchive, limits: NpzLimits) -> int | None:
    if "num_classes" not in archive.headers:
        return None
    header = archive.headers["num_classes"]
    if header.shape not in ((), (1,)) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: num_classes must be one integer")
    value = int(archive.read("num_classes").reshape(-1)[0])
    if value < 2:
        raise DataError(f"{path}: num_classes {value} must be >= 2")
    if value > limits.classes:
        raise DataError(f"{path}: num_classes {value:,} is more than the {limits.classes:,} "
                        "classes a run may have (docs/own-data.md#limits)")
    return value


def describe_shape(shape: tuple[int, ...]) -> str:
    """One record's shape in words: "6 features" or "images 1x8x8"."""
    return (f"{shape[0]} features" if len(shape) == 1
            else "images " + "x".join(str(d) for d in shape))


def _data_files(root: Path, limits: NpzLimits) -> tuple[tuple[Path, ...], Path | None]:
    """The client files and the test file of ``--data ROOT`` (a folder or one file)."""
    if root.is_dir():
        files = folder_entries(root, limits)  # each a regular file, none skipped
        clients = tuple(p for p in files if p.name != TEST_FILE)
        if not clients:
            raise DataError(f"{root} holds no client .npz files (one per client, with arrays "
                            "x and y)")
        return clients, (root / TEST_FILE if len(files) > len(clients) else None)
    if not os.path.lexists(root):
        raise DataError(f"--data {root}: no such file or folder")
    return (root,), None  # the reader refuses anything but a regular file


def _probe_file(file: Path, folder: Path | None, limits: NpzLimits) -> _FileFacts:
    """One file's headers, labels, num_classes and client ids, checked; x is not read."""
    with _records_archive(file, folder, limits) as archive:
        header = _records_header(file, archive.headers, limits)
        y = _labels(file, archive, header.shape[0], limits)
        declared = _declared_classes(file, archive, limits)
        sizes = None
        if folder is None and "client" in archive.headers:
            ids = _client_ids(file, archive, header.shape[0], limits)
            sizes = tuple(int(n) for n in np.bincount(ids))
    return _FileFacts(header, int(y.max()), declared, sizes)


def probe(path: str | Path, limits: NpzLimits = LIMITS) -> DataLayout:
    """The layout of a user's data (module docstring): array headers and labels, checked
    against ``limits`` before anything they describe is allocated; no feature is read."""
    root = Path(path).expanduser()
    clients, test = _data_files(root, limits)
    folder = root if root.is_dir() else None
    reference: tuple[Path, NpyHeader] | None = None
    declared: tuple[Path, int] | None = None
    top = -1
    sizes: list[int] = []
    facts: dict[Path, _FileFacts] = {}
    for file in (*clients, *((test,) if test else ())):
        facts[file] = fact = _probe_file(file, folder, limits)
        header = fact.x
        if reference is None:
            reference = (file, header)
        elif header.shape[1:] != reference[1].shape[1:]:
            raise DataError(f"{file} has {describe_shape(header.shape[1:])}, {reference[0].name} "
                            f"has {describe_shape(reference[1].shape[1:])}: every client (and the "
                            "test set) must hold records of one shape")
        elif header.dtype != reference[1].dtype:
            raise DataError(f"{file}: x is {header.dtype}, {reference[0].name}'s is "
                            f"{reference[1].dtype}: every file must hold x of one dtype")
        if fact.declared is not None:
            if declared is not None and fact.declared != declared[1]:
                raise DataError(f"{file} declares num_classes {fact.declared}, "
                                f"{declared[0].name} {declared[1]}: the clients' label sets "
                                "disagree")
            declared = (file, fact.declared)
        if file == test:
            if top >= 0 and declared is None and fact.top > top:
                raise DataError(f"{file}: label {fact.top} is not among the clients' "
                                f"labels 0..{top} (declare num_classes in every file)")
        else:
            top = max(top, fact.top)
            sizes.append(header.shape[0])
        if fact.client_sizes is not None:
            sizes = list(fact.client_sizes)
    assert reference is not None
    _check_data_bytes(root, [f.x for f in facts.values()], limits)
    num_classes = declared[1] if declared is not None else top + 1
    for file, fact in facts.items():
        if fact.top >= num_classes:
            raise DataError(f"{file}: label {fact.top} is out of range 0..{num_classes - 1}")
    if num_classes < 2:
        raise DataError(f"{root}: every label is 0; a classifier needs at least two classes")
    shape = reference[1].shape[1:]
    if len(shape) == 3 and shape[1] * shape[2] * num_classes > limits.image_classes:
        raise DataError(f"{root}: images {shape[1]}x{shape[2]} with {num_classes:,} classes "
                        f"ask for a last layer of about {2 * shape[1] * shape[2] * num_classes:,}"
                        f" weights; height x width x classes may be at most "
                        f"{limits.image_classes:,} (docs/own-data.md#limits)")
    natural = folder is not None or facts[root].client_sizes is not None
    return DataLayout(root, clients, test, reference[1].shape[1:], num_classes, natural,
                      tuple(sizes))


def _client_ids(path: Path, archive: NpzArchive, records: int, limits: NpzLimits
                ) -> np.ndarray:
    header = archive.headers["client"]
    if header.shape != (records,) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: client must hold one integer per record of x ({records})")
    ids = archive.read("client").astype(np.int64)
    if ids.min() < 0:
        raise DataError(f"{path}: client id {int(ids.min())} is negative (ids are 0..K-1)")
    if ids.max() >= limits.clients:
        raise DataError(f"{path}: client id {int(ids.max()):,} asks for more than the "
                        f"{limits.clients:,} clients a run may have (docs/own-data.md#limits)")
    counts = np.bincount(ids)
    if (empty := np.flatnonzero(counts == 0)).size:
        raise DataError(f"{path}: an empty client: id {int(empty[0])} has no records (client "
                        f"ids must be 0..{len(counts) - 1} without gaps)")
    return ids


def _checked_features(path: Path | str, x: np.ndarray) -> np.ndarray:
    """``x`` (already in memory: IDX records) as a float32 array of its own (writable, C
    order), refused if it holds NaN or inf once cast (:func:`~fedlap_privacy.data.record_features.
    check_finite`: a float64 beyond float32's range becomes inf in the cast)."""
    with np.errstate(over="ignore", invalid="ignore"):
        x = x.astype(np.float32, order="C", copy=not x.flags.writeable)
    check_finite(path, x)
    return x


def _file_labels(file: Path, archive: NpzArchive, layout: DataLayout, records: int | None,
                 limits: NpzLimits) -> tuple[np.ndarray, np.ndarray | None]:
    """One file of ``layout``'s labels (and client ids), under the checks of :func:`probe`
    again: a file changed since it was probed (``records``: its probed count) is refused."""
    header = _records_header(file, archive.headers, limits)
    if header.shape[1:] != layout.input_shape or records not in (None, header.shape[0]):
        raise DataError(f"{file} changed while it was read: x now holds "
                        f"{header.shape[0]:,} records of {describe_shape(header.shape[1:])}")
    y = _labels(file, archive, header.shape[0], limits)
    if y.max() >= layout.num_classes:
        raise DataError(f"{file}: label {int(y.max())} is out of range "
                        f"0..{layout.num_classes - 1}")
    ids = (_client_ids(file, archive, header.shape[0], limits)
           if layout.folder is None and "client" in archive.headers else None)
    return y, ids


def held_out_count(n: int) -> int:
    """How many of a client's ``n`` records are held out without a test set:
    :data:`HOLDOUT_FRACTION` of them, rounded, leaving at least one in training."""
    return min(round(HOLDOUT_FRACTION * n), n - 1)


def _holdout(n: int, client: int, seed: int) -> np.ndarray:
    """A seeded draw of :func:`held_out_count` of a client's ``n`` records."""
    rng = np.random.default_rng([seed, client, n])
    return np.sort(rng.choice(n, held_out_count(n), replace=False))


def _held_out_targets(first_client: int, counts: np.ndarray, order: np.ndarray | None,
                      seed: int, train_at: int, test_at: int) -> RowTargets:
    """Where the rows of one file go when each client's :func:`_holdout` is held out: the
    file holds clients ``first_client, first_client + 1, ...`` with ``counts`` records each,
    in file order once grouped by ``order`` (None: already grouped). Training keeps each
    client's other records in file order, client after client, from ``train_at``; the
    held-out ones go the same way to the test array from ``test_at``."""
    held = np.zeros(int(counts.sum()), dtype=bool)
    starts = np.cumsum(counts) - counts
    for i, n in enumerate(counts.tolist()):
        held[starts[i] + _holdout(n, first_client + i, seed)] = True
    grouped = np.where(held, -test_at - np.cumsum(held), train_at - 1 + np.cumsum(~held))
    if order is None:
        return RowTargets(grouped)
    rows = np.empty_like(grouped)
    rows[order] = grouped
    return RowTargets(rows)


def load_user_data(path: str | Path, seed: int = 0, limits: NpzLimits = LIMITS) -> Dataset:
    """A user's data as a :class:`~fedlap_privacy.data.datasets.Dataset` named ``custom``, with its
    natural ``partition`` when it has one, and held out per client when it has no test set
    (module docstring). Everything is checked first (:func:`probe`), under ``limits``. The
    features go from each file, a block of rows at a time, straight into the training and
    test arrays (:mod:`fedlap_privacy.data.record_features`): the run holds them once."""
    layout = probe(path, limits)
    holding = layout.test is None
    sizes = np.asarray(layout.sizes, dtype=np.int64)
    held = np.asarray([held_out_count(n) if holding else 0 for n in layout.sizes], np.int64)
    if holding and held.sum() == 0:
        raise DataError(f"{layout.path}: too few records to hold any out for evaluation; add "
                        f"a {TEST_FILE}")
    kept = sizes - held
    train_at, test_at = np.cumsum(kept) - kept, np.cumsum(held) - held
    x_train = np.empty((int(kept.sum()), *layout.input_shape), dtype=np.float32)
    y_train = np.empty(len(x_train), dtype=np.int64)
    x_test = np.empty((int(held.sum()), *layout.input_shape), dtype=np.float32)
    y_test = np.empty(len(x_test), dtype=np.int64)
    for i, file in enumerate(layout.clients):
        single = layout.folder is None
        with _records_archive(file, layout.folder, limits) as archive:
            y, ids = _file_labels(file, archive, layout, int(sizes.sum() if single
                                                             else sizes[i]), limits)
            if not holding:
                targets = RowTargets(None, int(train_at[i]))
            elif ids is None:
                targets = _held_out_targets(i, sizes[i:i + 1], None, seed, int(train_at[i]),
                                            int(test_at[i]))
            else:
                if not np.array_equal(np.bincount(ids), sizes):
                    raise DataError(f"{file} changed while it was read: its client ids differ")
                targets = _held_out_targets(0, sizes, np.argsort(ids, kind="stable"), seed,
                                            0, 0)
            targets.place(0, y, y_train, y_test)
            read_features(archive, targets, x_train, x_test)
    if layout.test is not None:
        with _records_archive(layout.test, layout.folder, limits) as archive:
            y_test, _ = _file_labels(layout.test, archive, layout, None, limits)
            size = x_train.nbytes + len(y_test) * 4 * math.prod(layout.input_shape)
            if size > limits.data_bytes:
                raise DataError(f"{layout.test} changed while it was read: the features now "
                                f"take {size:,} bytes, more than the {limits.data_bytes:,} a "
                                "run reads")
            x_test = np.empty((len(y_test), *layout.input_shape), dtype=np.float32)
            read_features(archive, RowTargets(None), x_test)
    partition = tuple(np.arange(train_at[k], train_at[k] + kept[k], dtype=np.int64)
                      for k in range(len(kept))) if layout.natural else None
    return Dataset(
        name=CUSTOM, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
        num_classes=layout.num_classes, mean=(), std=(), partition=partition,
        held_out=holding,
    )


def load_run_data(dataset: str, config: dict[str, Any], split_seed: int | None,
                  path: str | Path | None = None) -> Dataset:
    """The ``dataset`` a saved run trained on, from its recorded configuration (its private
    state's): a built-in dataset from its ``data_dir``, or a user's records from their
    ``data`` path, held out with the run's split seed (``seed`` for a run saved before split
    seeds) exactly as the run held them out. ``path`` replaces the recorded folder or path."""
    if dataset != CUSTOM:
        return load_dataset(dataset, path if path is not None else config.get("data_dir"))
    used = path if path is not None else config.get("data")
    if used is None:
        raise DataError("the run's data path is not recorded: pass --data-dir PATH")
    seed = split_seed if split_seed is not None else int(config.get("seed", 0))
    return load_user_data(used, seed)


def load_records(spec: str | Path, normalise: tuple[float, float] | None = None,
                 limits: NpzLimits = LIMITS) -> Records:
    """ONE party's records, the one reader of a file of records: a Flower node's
    ``data-file``, ``audit``'s ``--members`` / ``--nonmembers``. ``spec`` is an ``.npz`` with
    ``x`` and ``y`` and optionally ``num_classes``, under the checks of one file of
    :func:`probe` and :func:`load_user_data` (headers and ``limits`` first, then the labels,
    then the features; no pickle), or ``IMAGES,LABELS``, a pair of IDX files
    (:func:`fedlap_privacy.data.dataset_files.read_idx_records`; ``normalise``: their ``(mean,
    std)``) under the same checks. Its labels need not cover every class (a node may hold one); a
    ``client`` array is refused: the file is the party's own records."""
    if "," in str(spec):
        images, labels = (Path(p.strip()).expanduser() for p in str(spec).split(",", 1))
        x, y = read_idx_records(images, labels, normalise)
        _check_x(spec, NpyHeader(x.shape, x.dtype), limits)
        y = _checked_labels(spec, NpyHeader(y.shape, y.dtype), len(x), lambda: y, limits)
        return Records(images, _checked_features(spec, x), y, None)
    file = Path(spec).expanduser()
    with _records_archive(file, None, limits) as archive:
        header = _records_header(file, archive.headers, limits)
        if "client" in archive.headers:
            raise DataError(f"{file}: a client array splits a file among clients (--data); a "
                            "node's data file holds its own records only")
        _check_data_bytes(file, [header], limits)
        y = _labels(file, archive, header.shape[0], limits)
        declared = _declared_classes(file, archive, limits)
        if declared is not None and int(y.max()) >= declared:
            raise DataError(f"{file}: label {int(y.max())} is out of range 0..{declared - 1}")
        x = np.empty(header.shape, dtype=np.float32)
        read_features(archive, RowTargets(None), x)
    return Records(file, x, y, declared)
