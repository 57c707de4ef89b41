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

Checks, each one :class:`~fedlap_privacy.errors.DataError` line naming the file: a folder
without client ``.npz`` files, missing arrays, clients (or the test set) that disagree on
the feature count, image shape or dtype of ``x``, disagreeing ``num_classes``, a test label
the clients' classes do not cover, labels out of range, an empty client, NaN or inf in
``x``. :func:`probe` reads the archives' array headers and the labels only, so that the run
can refuse a bad layout (or a model, :mod:`fedlap_privacy.model_factory`) before any
record's features are read; :func:`load_user_data` then reads and checks everything.
:func:`load_records` reads ONE party's file under the same checks (a Flower node's
``data-file``, audit's ``--members`` / ``--nonmembers``): the package's one reader of a
file of records. :func:`load_run_data` reads a saved run's dataset again.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlap_privacy.data import CUSTOM, Dataset, load_dataset
from fedlap_privacy.dataset_files import read_idx_records, read_npz_array
from fedlap_privacy.errors import DataError

__all__ = ["HELD_OUT_NOTE", "HOLDOUT_FRACTION", "TEST_FILE", "DataLayout", "NpyHeader",
           "Records", "describe_shape", "held_out_count", "load_records", "load_run_data",
           "load_user_data", "npz_headers", "probe"]

TEST_FILE = "test.npz"
#: share of each client's records held out for evaluation when there is no test set
HOLDOUT_FRACTION = 0.2
#: what a run without a test set declares public (its accuracy is measured on private records)
HELD_OUT_NOTE = ("the test accuracy and loss of every round, measured on records held out of "
                 "the clients' own data (no test.npz): not covered by epsilon")


@dataclass(frozen=True)
class NpyHeader:
    """What an ``.npy`` member's header says, read without its data."""

    shape: tuple[int, ...]
    dtype: np.dtype


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


def npz_headers(path: Path) -> dict[str, NpyHeader]:
    """The arrays of an ``.npz`` and their headers; object arrays (pickles) are refused."""
    if not path.is_file():
        raise DataError(f"no such file: {path}")
    out: dict[str, NpyHeader] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(f)
                out[info.filename[:-4]] = NpyHeader(tuple(shape), np.dtype(dtype))
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"cannot read {path} as .npz: {str(exc)[:120]}") from None
    for name, header in out.items():
        if header.dtype.hasobject:
            raise DataError(f"{path}: array {name!r} holds Python objects (a pickle), which "
                            "is never loaded; save plain numbers")
    return out


def _check_x(path: Path | str, header: NpyHeader) -> None:
    if len(header.shape) not in (2, 4):
        raise DataError(f"{path}: x has shape {header.shape}; expected images (N, C, H, W) "
                        "or feature rows (N, D)")
    if header.dtype.kind not in "fiu":
        raise DataError(f"{path}: x has dtype {header.dtype}; expected numbers")
    if header.shape[0] == 0:
        raise DataError(f"{path}: an empty client (x has no records)")
    if 0 in header.shape[1:]:
        raise DataError(f"{path}: x has shape {header.shape}; a record cannot be empty")


def _records_header(path: Path, members: dict[str, NpyHeader]) -> NpyHeader:
    """The header of ``x`` in a file of records, checked (arrays ``x`` and ``y`` present)."""
    missing = [a for a in ("x", "y") if a not in members]
    if missing:
        raise DataError(f"{path}: an .npz of records needs arrays 'x' and 'y' "
                        f"(missing {', '.join(missing)})")
    header = members["x"]
    _check_x(path, header)
    return header


def _labels(path: Path, members: dict[str, NpyHeader], records: int) -> np.ndarray:
    return _checked_labels(path, NpyHeader(members["y"].shape, members["y"].dtype), records,
                           lambda: read_npz_array(path, "y"))


def _checked_labels(path: Path | str, header: NpyHeader, records: int,
                    read: Callable[[], np.ndarray]) -> np.ndarray:
    """The labels ``read()`` returns, once ``header`` says one integer per record; >= 0."""
    if header.shape != (records,) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: y must hold one integer label per record of x ({records}), "
                        f"found {header.dtype} {header.shape}")
    y = read().astype(np.int64)
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: label {int(y.min())} is out of range (labels are 0..K-1)")
    return y


def _declared_classes(path: Path, members: dict[str, NpyHeader]) -> int | None:
    if "num_classes" not in members:
        return None
    header = members["num_classes"]
    if header.shape not in ((), (1,)) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: num_classes must be one integer")
    value = int(read_npz_array(path, "num_classes").reshape(-1)[0])
    if value < 2:
        raise DataError(f"{path}: num_classes {value} must be >= 2")
    return value


def describe_shape(shape: tuple[int, ...]) -> str:
    """One record's shape in words: "6 features" or "images 1x8x8"."""
    return (f"{shape[0]} features" if len(shape) == 1
            else "images " + "x".join(str(d) for d in shape))


def probe(path: str | Path) -> DataLayout:
    """The layout of a user's data (module docstring): array headers and labels, checked;
    no feature is read."""
    root = Path(path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.iterdir() if p.suffix == ".npz" and p.is_file())
        clients = tuple(p for p in files if p.name != TEST_FILE)
        test = root / TEST_FILE if (root / TEST_FILE).is_file() else None
        if not clients:
            raise DataError(f"{root} holds no client .npz files (one per client, with arrays "
                            "x and y)")
    elif root.is_file():
        clients, test = (root,), None
    else:
        raise DataError(f"--data {root}: no such file or folder")
    reference: tuple[Path, NpyHeader] | None = None
    declared: tuple[Path, int] | None = None
    top = -1
    natural = root.is_dir()
    sizes: list[int] = []
    for file in (*clients, *((test,) if test else ())):
        members = npz_headers(file)
        header = _records_header(file, members)
        if reference is None:
            reference = (file, header)
        elif header.shape[1:] != reference[1].shape[1:]:
            raise DataError(f"{file} has {describe_shape(header.shape[1:])}, {reference[0].name} "
                            f"has {describe_shape(reference[1].shape[1:])}: every client (and the "
                            "test set) must hold records of one shape")
        elif header.dtype != reference[1].dtype:
            raise DataError(f"{file}: x is {header.dtype}, {reference[0].name}'s is "
                            f"{reference[1].dtype}: every file must hold x of one dtype")
        y = _labels(file, members, header.shape[0])
        classes = _declared_classes(file, members)
        if classes is not None:
            if declared is not None and classes != declared[1]:
                raise DataError(f"{file} declares num_classes {classes}, {declared[0].name} "
                                f"{declared[1]}: the clients' label sets disagree")
            declared = (file, classes)
        if file == test:
            if top >= 0 and declared is None and int(y.max()) > top:
                raise DataError(f"{file}: label {int(y.max())} is not among the clients' "
                                f"labels 0..{top} (declare num_classes in every file)")
        else:
            top = max(top, int(y.max()))
            sizes.append(header.shape[0])
        if file == root and "client" in members:
            natural = True
            sizes = np.bincount(_client_ids(file, members, header.shape[0])).tolist()
    assert reference is not None
    num_classes = declared[1] if declared is not None else top + 1
    for file in (*clients, *((test,) if test else ())):
        y = read_npz_array(file, "y")
        if int(y.max()) >= num_classes:
            raise DataError(f"{file}: label {int(y.max())} is out of range 0..{num_classes - 1}")
    if num_classes < 2:
        raise DataError(f"{root}: every label is 0; a classifier needs at least two classes")
    return DataLayout(root, clients, test, reference[1].shape[1:], num_classes, natural,
                      tuple(int(n) for n in sizes))


def _client_ids(path: Path, members: dict[str, NpyHeader], records: int) -> np.ndarray:
    header = members["client"]
    if header.shape != (records,) or header.dtype.kind not in "iu":
        raise DataError(f"{path}: client must hold one integer per record of x ({records})")
    ids = read_npz_array(path, "client").astype(np.int64)
    if ids.min() < 0:
        raise DataError(f"{path}: client id {int(ids.min())} is negative (ids are 0..K-1)")
    counts = np.bincount(ids)
    if (empty := np.flatnonzero(counts == 0)).size:
        raise DataError(f"{path}: an empty client: id {int(empty[0])} has no records (client "
                        f"ids must be 0..{len(counts) - 1} without gaps)")
    return ids


def _features(path: Path) -> np.ndarray:
    return _checked_features(path, read_npz_array(path, "x"))


def _checked_features(path: Path | str, x: np.ndarray) -> np.ndarray:
    """``x`` as a float32 array of its own (writable, C order), refused if it holds NaN or
    inf."""
    finite = np.isfinite(x) if x.dtype.kind == "f" else np.ones(1, dtype=bool)
    if not finite.all():
        bad = int(np.argwhere(~finite)[0][0])
        raise DataError(f"{path}: x holds NaN or inf (record {bad}): remove or impute "
                        "the NaN or infinite values")
    return np.array(x, dtype=np.float32, order="C")


def held_out_count(n: int) -> int:
    """How many of a client's ``n`` records are held out without a test set:
    :data:`HOLDOUT_FRACTION` of them, rounded, leaving at least one in training."""
    return min(round(HOLDOUT_FRACTION * n), n - 1)


def _holdout(n: int, client: int, seed: int) -> np.ndarray:
    """A seeded draw of :func:`held_out_count` of a client's ``n`` records."""
    rng = np.random.default_rng([seed, client, n])
    return np.sort(rng.choice(n, held_out_count(n), replace=False))


def load_user_data(path: str | Path, seed: int = 0) -> Dataset:
    """A user's data as a :class:`~fedlap_privacy.data.Dataset` named ``custom``, with its
    natural ``partition`` when it has one, and held out per client when it has no test set
    (module docstring). Everything is checked first (:func:`probe`)."""
    layout = probe(path)
    if layout.natural and layout.clients[0] == layout.path:
        x_all, y_all = _features(layout.path), read_npz_array(layout.path, "y").astype(np.int64)
        ids = _client_ids(layout.path, npz_headers(layout.path), len(y_all))
        # grouped by id in one stable sort (each client's records in file order): linear in
        # the records, not records x clients, for thousands of clients
        order = np.argsort(ids, kind="stable")
        cuts = np.cumsum(np.bincount(ids))[:-1]
        pieces = list(zip(np.split(x_all[order], cuts), np.split(y_all[order], cuts),
                          strict=True))
    else:
        pieces = [(_features(p), read_npz_array(p, "y").astype(np.int64)) for p in layout.clients]
    held_out = layout.test is None
    if layout.test is not None:
        x_test = _features(layout.test)
        y_test = read_npz_array(layout.test, "y").astype(np.int64)
        train = pieces
    elif layout.natural:
        masks = []
        for k, (_, y) in enumerate(pieces):
            mask = np.zeros(len(y), dtype=bool)
            mask[_holdout(len(y), k, seed)] = True
            masks.append(mask)
        train = [(x[~m], y[~m]) for (x, y), m in zip(pieces, masks, strict=True)]
        x_test = np.concatenate([x[m] for (x, _), m in zip(pieces, masks, strict=True)])
        y_test = np.concatenate([y[m] for (_, y), m in zip(pieces, masks, strict=True)])
    else:
        x, y = pieces[0]
        mask = np.zeros(len(y), dtype=bool)
        mask[_holdout(len(y), 0, seed)] = True
        train = [(x[~mask], y[~mask])]
        x_test, y_test = x[mask], y[mask]
    if len(y_test) == 0:
        raise DataError(f"{layout.path}: too few records to hold any out for evaluation; add "
                        f"a {TEST_FILE}")
    sizes = [len(y) for _, y in train]
    starts = np.cumsum([0, *sizes])
    partition = tuple(np.arange(starts[k], starts[k + 1], dtype=np.int64)
                      for k in range(len(sizes))) if layout.natural else None
    return Dataset(
        name=CUSTOM, x_train=np.concatenate([x for x, _ in train]),
        y_train=np.concatenate([y for _, y in train]), x_test=x_test, y_test=y_test,
        num_classes=layout.num_classes, mean=(), std=(), partition=partition,
        held_out=held_out,
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


def load_records(spec: str | Path, normalise: tuple[float, float] | None = None) -> Records:
    """ONE party's records, the one reader of a file of records: a Flower node's
    ``data-file``, ``audit``'s ``--members`` / ``--nonmembers``. ``spec`` is an ``.npz`` with
    ``x`` and ``y`` and optionally ``num_classes``, under the checks of one file of
    :func:`probe` and :func:`load_user_data` (headers first, then the features, then the
    labels; no pickle), or ``IMAGES,LABELS``, a pair of IDX files
    (:func:`fedlap_privacy.dataset_files.read_idx_records`; ``normalise``: their ``(mean, std)``)
    under the same checks. Its labels need not cover every class (a node may hold one); a
    ``client`` array is refused: the file is the party's own records."""
    if "," in str(spec):
        images, labels = (Path(p.strip()).expanduser() for p in str(spec).split(",", 1))
        x, y = read_idx_records(images, labels, normalise)
        _check_x(spec, NpyHeader(x.shape, x.dtype))
        y = _checked_labels(spec, NpyHeader(y.shape, y.dtype), len(x), lambda: y)
        return Records(images, _checked_features(spec, x), y, None)
    file = Path(spec).expanduser()
    members = npz_headers(file)
    header = _records_header(file, members)
    if "client" in members:
        raise DataError(f"{file}: a client array splits a file among clients (--data); a "
                        "node's data file holds its own records only")
    x = _features(file)  # a header that declares more than the file holds is refused here
    y = _labels(file, members, header.shape[0])
    declared = _declared_classes(file, members)
    if declared is not None and int(y.max()) >= declared:
        raise DataError(f"{file}: label {int(y.max())} is out of range 0..{declared - 1}")
    return Records(file, x, y, declared)
