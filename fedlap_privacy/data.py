"""Datasets, their file readers and the client splits (docs/algorithms.md#model-and-data).

Four image datasets, all returned as float32 ``(N, C, H, W)`` arrays normalised with fixed
per-channel mean/std constants (never computed from the data at run time):

* ``digits`` -- scikit-learn's bundled 8x8 digits; a fixed stratified 80/20 split.
* ``mnist``, ``fashion-mnist`` -- the standard IDX files (gzipped or not) in ``data_dir``.
* ``cifar10`` -- the CIFAR-10 "python version" batches. They are pickles, i.e. untrusted
  input, so they are read with an unpickler that can only rebuild dicts, lists, bytes, ints
  and uint8 numpy arrays; anything else (``os.system``, ``eval``, ...) is refused unrun.

Files already on disk are validated by format (magic numbers, sizes, shapes, label range),
not by checksum, so users may bring their own subsets. ``download=True`` fetches missing
files from the standard mirrors and verifies the published MD5 checksums; without it the
network is never touched. Every problem is a :class:`DataError` naming the file, or a
:class:`ConfigError` naming the bad argument.

Splits (:func:`split_clients`): the paper's non-IID split (5 clients x 2 classes, class
order ``[5, 6, 1, 2, 0, 8, 9, 3, 4, 7]``, each client holding all records of its classes),
IID, Dirichlet(alpha) label skew, and two cross-device splits for thousands of clients with
a few records each: McMahan et al. 2017's label shards and a Dirichlet(alpha) label mix per
client (Hsu et al. 2019).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import pickle
import struct
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from fedlap_privacy.atomic import atomic_file
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
DIGITS_SPLIT_SEED = 0  # numpy RandomState seed of the fixed stratified digits split
DIGITS_TEST_FRACTION = 0.2

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
IDX_IMAGE_MAGIC, IDX_LABEL_MAGIC = 2051, 2049
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_BATCH_ROWS = 10000

MIRRORS = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/",
}
# Published MD5 checksums of the downloaded files (as listed by torchvision's datasets).
CHECKSUMS: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {CIFAR_ARCHIVE: "c58f30108f718f92721af3b95e74349a"},
}
_DOWNLOAD_TIMEOUT_S = 60
_CHUNK = 1 << 20
_DIRICHLET_TRIES = 100


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of float32 inputs and int64 labels: normalised images
    ``(N, C, H, W)`` (the built-in datasets and a user's images) or feature rows ``(N, D)``
    (a user's tabular data, :mod:`fedlap_privacy.user_data`).

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


def content_hash(*arrays: np.ndarray) -> str:
    """SHA-256 of arrays' dtypes, shapes and bytes: pins the exact records a run used."""
    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.tobytes())
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
    root = Path(data_dir) if data_dir is not None else Path("data") / name
    if name == "cifar10":
        return _load_cifar10(root, download)
    return _load_idx_dataset(name, root, download)


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
    paths = [_idx_path(name, root, stem, download) for stem in IDX_FILES]
    arrays = []
    for images, labels in (paths[:2], paths[2:]):
        x = _read_idx(images, IDX_IMAGE_MAGIC, ndim=3)
        y = _read_idx(labels, IDX_LABEL_MAGIC, ndim=1)
        if x.shape[1:] != (28, 28):
            raise DataError(f"{images}: images are {x.shape[1]}x{x.shape[2]}, expected 28x28")
        if len(x) != len(y):
            raise DataError(f"{labels}: {len(y)} labels for {len(x)} images in {images}")
        if y.max() >= NUM_CLASSES:
            raise DataError(f"{labels}: label {int(y.max())} is out of range 0..9")
        arrays += [x.reshape(-1, 1, 28, 28), y]
    return _make_dataset(name, *arrays)


def _idx_path(name: str, root: Path, stem: str, download: bool) -> Path:
    """The raw file if present, else the gzipped one, else download it (or fail)."""
    for path in (root / stem, root / f"{stem}.gz"):
        if path.is_file():
            return path
    target = root / f"{stem}.gz"
    if not download:
        raise DataError(
            f"missing dataset file {target} (or {root / stem}); fetch it with --download"
        )
    _download(MIRRORS[name] + target.name, target, CHECKSUMS[name][target.name])
    return target


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Parse one big-endian IDX file of unsigned bytes, checking header and exact size."""
    header_size = 4 + 4 * ndim
    try:
        if path.suffix != ".gz" and path.stat().st_size < header_size:
            raise DataError(f"{path}: truncated IDX header")
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            header = f.read(header_size)
            if len(header) < header_size:
                raise DataError(f"{path}: truncated IDX header")
            found, *dims = struct.unpack(f">{1 + ndim}i", header)
            if found != magic:
                raise DataError(f"{path}: bad magic number {found}, expected {magic}")
            if dims[0] < 1 or min(dims) < 0:
                raise DataError(f"{path}: bad dimensions {dims} in the IDX header")
            count = math.prod(dims)
            if path.suffix != ".gz" and path.stat().st_size != header_size + count:
                raise DataError(
                    f"{path}: file size {path.stat().st_size} does not match its "
                    f"header ({header_size + count} bytes for dimensions {dims})"
                )
            body = _read_at_most(f, count + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if len(body) != count:
        found_size = "more" if len(body) > count else str(len(body))
        raise DataError(
            f"{path}: data size does not match its header (expected {count} "
            f"bytes for dimensions {dims}, found {found_size})"
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def read_idx_records(images: Path, labels: Path, normalise: tuple[float, float] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Records ``(x, y)`` from a pair of IDX files a user brings (raw or gzipped): images
    ``(N, 1, H, W)`` scaled to [0, 1] and, with ``normalise=(mean, std)``, standardised;
    int64 labels. Read without pickles; the records' checks are
    :func:`fedlap_privacy.user_data.load_records`'s, which calls this."""
    x = _read_idx(images, IDX_IMAGE_MAGIC, ndim=3).astype(np.float32)[:, None] / 255.0
    y = _read_idx(labels, IDX_LABEL_MAGIC, ndim=1).astype(np.int64)
    if normalise is not None:
        x = (x - normalise[0]) / normalise[1]
    return x, y


def read_npz_array(path: Path, key: str) -> np.ndarray:
    """Array ``key`` of a user's ``.npz``, read without pickles and without trusting its
    header: the declared shape must fit in the bytes the member holds (a forged shape cannot
    make us allocate), and a truncated or corrupt archive is a DataError naming the file."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = next((i for i in archive.infolist() if i.filename in (key, f"{key}.npy")),
                        None)
            if info is None:
                raise DataError(f"{path}: an .npz of records needs arrays 'x' and 'y'")
            with archive.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise DataError(f"{path}: array {key!r} has .npy format {version}")
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(f)
                if dtype.hasobject:
                    raise DataError(f"{path}: array {key!r} holds Python objects (pickles are "
                                    "not read)")
                size = math.prod(shape) * dtype.itemsize
                body = _read_at_most(f, min(size, info.file_size))
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(f"cannot read {path} as .npz: {str(exc)[:120]}") from None
    if len(body) != size:
        raise DataError(f"{path}: array {key!r} declares shape {shape} ({size:,} bytes) but "
                        f"holds {len(body):,}: the file is truncated or forged")
    return np.frombuffer(body, dtype).reshape(shape, order="F" if fortran else "C")


def _read_at_most(f: IO[bytes], limit: int) -> bytes:
    """Read up to ``limit`` bytes in chunks (no up-front allocation from a forged header)."""
    parts, size = [], 0
    while size < limit and (chunk := f.read(min(_CHUNK, limit - size))):
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


# ---------------------------------------------------------------------------- CIFAR-10


def _load_cifar10(root: Path, download: bool) -> Dataset:
    folder = _cifar_folder(root, download)
    train = [_read_cifar_batch(folder / name) for name in CIFAR_TRAIN]
    x_test, y_test = _read_cifar_batch(folder / CIFAR_TEST)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    return _make_dataset("cifar10", x_train, y_train, x_test, y_test)


def _cifar_folder(root: Path, download: bool) -> Path:
    names = (*CIFAR_TRAIN, CIFAR_TEST)
    for folder in (root / CIFAR_DIR, root):
        if all((folder / name).is_file() for name in names):
            return folder
    folder = root / CIFAR_DIR if (root / CIFAR_DIR).is_dir() else root
    if not download:
        missing = next(folder / name for name in names if not (folder / name).is_file())
        raise DataError(
            f"missing dataset file {missing} (looked in {root / CIFAR_DIR} and "
            f"{root}); fetch it with --download"
        )
    archive = root / CIFAR_ARCHIVE
    if not archive.is_file():
        _download(MIRRORS["cifar10"] + CIFAR_ARCHIVE, archive, CHECKSUMS["cifar10"][CIFAR_ARCHIVE])
    _extract_cifar(archive, root / CIFAR_DIR)
    return root / CIFAR_DIR


def _extract_cifar(archive: Path, folder: Path) -> None:
    """Extract only the six batch files, to paths we build ourselves (no path traversal)."""
    wanted = {f"{CIFAR_DIR}/{name}": name for name in (*CIFAR_TRAIN, CIFAR_TEST)}
    found = set()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name in wanted and member.name not in found:
                    source = tar.extractfile(member)
                    assert source is not None  # regular files always have a stream
                    _save_atomic(source, folder / wanted[member.name])
                    found.add(member.name)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot extract {archive}: {exc}") from exc
    if missing := sorted(set(wanted) - found):
        raise DataError(f"{archive} lacks {missing[0]}")


class _ForbiddenGlobal(pickle.UnpicklingError):
    """The pickle asks for a class or function outside the CIFAR-10 allow-list."""


def _latin1_encode(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles from Python 3 use it for bytes, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise _ForbiddenGlobal("_codecs.encode with arguments other than (str, 'latin1')")
    return text.encode("latin1")


_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy's array rebuilder, under any numpy path
_CIFAR_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild plain containers and numpy arrays (no code)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _CIFAR_GLOBALS[(module, name)]
        except KeyError:
            raise _ForbiddenGlobal(f"{module}.{name}") from None


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 batch: ``(N, 3, 32, 32)`` uint8 images and int64 labels."""
    try:
        with open(path, "rb") as f:
            # Written by Python 2 cPickle: str objects become bytes with encoding="bytes".
            batch = _CifarUnpickler(f, encoding="bytes").load()
    except _ForbiddenGlobal as exc:
        raise DataError(
            f"refusing to load {path}: it references {exc}, which a CIFAR-10 "
            "batch never contains (possibly malicious)"
        ) from None
    except Exception as exc:  # untrusted input: any failure means a corrupt file
        raise DataError(
            f"cannot read {path}: not a CIFAR-10 batch pickle "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: not a CIFAR-10 batch (a {type(batch).__name__}, not a dict)")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
        or not 1 <= data.shape[0] <= CIFAR_BATCH_ROWS
    ):
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{path}: 'data' must be a uint8 array of shape (<= {CIFAR_BATCH_ROWS}, "
            f"3072), found {type(data).__name__} {shape or ''}".rstrip()
        )
    try:
        y = np.asarray(labels)
    except Exception:  # ragged or odd objects
        y = np.asarray([])
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(data):
        raise DataError(f"{path}: 'labels' must be {len(data)} integers, one per image")
    if (bad := y[(y < 0) | (y >= NUM_CLASSES)]).size:
        raise DataError(f"{path}: label {int(bad[0])} is out of range 0..9")
    return data.reshape(-1, 3, 32, 32), y.astype(np.int64)


# ---------------------------------------------------------------------------- download


def _download(url: str, target: Path, md5: str) -> None:
    """Fetch ``url`` into ``target`` atomically, verifying its published MD5 checksum."""
    try:
        with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            _save_atomic(response, target, md5=md5)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise DataError(f"cannot download {target.name} from {url}: {exc}") from exc


def _save_atomic(source: IO[bytes], target: Path, md5: str | None = None) -> None:
    """Copy a stream to ``target`` atomically, refusing it (nothing saved) on an MD5 mismatch."""
    digest = hashlib.md5(usedforsecurity=False)
    with atomic_file(target) as out:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
        if md5 is not None and digest.hexdigest() != md5:
            raise DataError(
                f"checksum mismatch for {target.name}: MD5 {digest.hexdigest()}, "
                f"expected {md5}; the file was not saved"
            )


# ------------------------------------------------------------------------------ splits


def holdout_indices(num_records: int, records: int, seed: int) -> np.ndarray:
    """A uniformly random, sorted set of ``records`` of ``num_records`` training indices,
    drawn from ``seed``: a validation split carved from the training data."""
    if not 1 <= records < num_records:
        raise ConfigError(f"a validation split of {records} records needs 1 <= records < "
                          f"{num_records} (the training records)")
    rng = np.random.default_rng([seed, num_records, records])
    return np.sort(rng.choice(num_records, records, replace=False)).astype(np.int64)


def subsample_parts(parts: list[np.ndarray], records: int, seed: int) -> list[np.ndarray]:
    """Each part cut to at most ``records`` indices, a uniformly random subset (sorted) drawn
    from ``seed``: smaller clients with the split's class mix (e.g. FashionMNIST's non-IID
    split at 1,600 instead of 12,000 records per client)."""
    if records < 1:
        raise ConfigError(f"records per client must be >= 1, got {records}")
    rng = np.random.default_rng([seed, records])
    return [p if p.size <= records else np.sort(rng.choice(p, records, replace=False))
            for p in parts]


def split_clients(
    labels: np.ndarray,
    num_clients: int,
    kind: str = "noniid",
    alpha: float = 0.5,
    seed: int = 0,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Partition the training set among clients (docs/algorithms.md#splits); sorted int64
    index arrays.

    * ``noniid`` -- the paper's split: the class order ``[5,6,1,2,0,8,9,3,4,7]`` (range
      order unless there are 10 classes) cut into ``num_clients`` contiguous groups with
      ``np.array_split``; each client holds all records of its classes.
    * ``iid`` -- a random permutation cut into ``num_clients`` nearly equal parts.
    * ``dirichlet`` -- per class, shares ~ Dirichlet(alpha * ones); resampled (a bounded
      number of times) until every client has at least one record.
    * ``shards`` -- McMahan et al. 2017 (Communication-efficient learning of deep networks
      from decentralized data, section 3): the records sorted by label (in a random order
      within a label), cut into ``2 * num_clients`` shards, two random shards per client.
    * ``label-dirichlet`` -- Hsu et al. 2019 (Measuring the effects of non-identical data
      distribution): every client gets N / num_clients records (up to one) whose labels
      follow its own mix q_k ~ Dirichlet(alpha * ones) over the classes, drawn without
      replacement (a class that runs out leaves the mix). Every client is non-empty by
      construction, so it scales to thousands of clients of a few records each.

    Deterministic given ``seed``; the parts are disjoint and cover every record.
    """
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0 or y.dtype.kind not in "iu":
        raise ConfigError("labels must be a non-empty 1-D array of integers")
    if (
        isinstance(num_clients, bool)
        or not isinstance(num_clients, int | np.integer)
        or num_clients < 1
    ):
        raise ConfigError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if kind not in SPLITS:
        raise ConfigError(f"unknown split kind {kind!r}; choose one of {', '.join(SPLITS)}")
    classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if y.min() < 0 or y.max() >= classes:
        raise ConfigError(
            f"labels must lie in 0..{classes - 1}, found {int(y.min())}..{int(y.max())}"
        )
    if kind != "noniid" and num_clients > len(y):
        raise ConfigError(f"num_clients {num_clients} exceeds the {len(y)} training records")
    if kind == "shards" and 2 * num_clients > len(y):
        raise ConfigError(f"the shards split cuts {2 * num_clients} shards (2 per client) "
                          f"from {len(y)} training records: at most {len(y) // 2} clients")
    rng = np.random.default_rng(seed)

    if kind == "noniid":
        if num_clients > classes:
            raise ConfigError(
                f"the noniid split needs num_clients <= {classes} classes, got {num_clients}"
            )
        order = np.asarray(PAPER_CLASS_ORDER if classes == NUM_CLASSES else range(classes))
        parts = []
        for group in np.array_split(order, num_clients):
            part = np.flatnonzero(np.isin(y, group)).astype(np.int64)
            if part.size == 0:
                raise ConfigError(f"noniid split: classes {group.tolist()} have no records")
            parts.append(part)
        return parts

    if kind == "iid":
        return [
            np.sort(p).astype(np.int64)
            for p in np.array_split(rng.permutation(len(y)), num_clients)
        ]

    if kind == "shards":
        return _shards(y, num_clients, rng)

    try:
        concentration = float(alpha)
    except (TypeError, ValueError):
        concentration = math.nan
    if not (math.isfinite(concentration) and concentration > 0):
        raise ConfigError(f"dirichlet alpha must be a positive number, got {alpha!r}")
    if kind == "label-dirichlet":
        return _label_dirichlet(y, num_clients, concentration, classes, rng)
    by_class = [np.flatnonzero(y == c) for c in range(classes)]
    for _ in range(_DIRICHLET_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            if idx.size == 0:
                continue
            shares = rng.dirichlet(np.full(num_clients, concentration))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
            for bucket, piece in zip(buckets, np.split(rng.permutation(idx), cuts), strict=True):
                bucket.append(piece)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        if all(p.size for p in parts):
            return parts
    raise ConfigError(
        f"dirichlet split with alpha={alpha} left a client without records "
        f"after {_DIRICHLET_TRIES} draws; use a larger alpha or fewer clients"
    )


def _shards(y: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split (see :func:`split_clients`)."""
    shuffled = rng.permutation(len(y))
    by_label = shuffled[np.argsort(y[shuffled], kind="stable")]
    shards = np.array_split(by_label, 2 * num_clients)
    owner = rng.permutation(2 * num_clients)
    return [np.sort(np.concatenate([shards[owner[2 * k]], shards[owner[2 * k + 1]]]))
            .astype(np.int64) for k in range(num_clients)]


def _label_dirichlet(y: np.ndarray, num_clients: int, alpha: float, classes: int,
                     rng: np.random.Generator) -> list[np.ndarray]:
    """Hsu et al. 2019's split (see :func:`split_clients`): client k's labels drawn from its
    own q_k ~ Dirichlet(alpha), without replacement, classes that run out dropped."""
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in range(classes)]
    left = np.array([p.size for p in pools], dtype=np.int64)
    taken = np.zeros(classes, dtype=np.int64)
    mixes = rng.dirichlet(np.full(classes, alpha), size=num_clients)
    parts = []
    for k, size in enumerate(np.diff(np.linspace(0, len(y), num_clients + 1).astype(np.int64))):
        counts = np.zeros(classes, dtype=np.int64)
        need = int(size)
        while need > 0:
            weights = np.where(left > 0, mixes[k], 0.0)
            if weights.sum() <= 0:  # its mix is on exhausted classes only: any class left
                weights = (left > 0).astype(np.float64)
            draw = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            counts += draw
            left -= draw
            need -= int(draw.sum())
        parts.append(np.sort(np.concatenate(
            [pools[c][taken[c]:taken[c] + counts[c]] for c in range(classes)])).astype(np.int64))
        taken += counts
    return parts
