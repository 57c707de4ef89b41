"""The built-in datasets' files: readers, the safe CIFAR-10 unpickler and the downloads
(docs/algorithms.md#model-and-data).

* IDX files (MNIST, Fashion-MNIST, a user's own), gzipped or not: header, magic number and
  exact size checked, the size within the limit of one array of a user's records
  (:attr:`fedlap_privacy.data.npz_reader.NpzLimits.member_bytes`: a gzip bomb is refused from its
  header). A user's ``.npz`` archives are :mod:`fedlap_privacy.data.npz_reader`'s.
* CIFAR-10 "python version" batches are pickles, i.e. untrusted input, so they are read with
  an unpickler that can only rebuild dicts, lists, bytes, ints and uint8 numpy arrays;
  anything else (``os.system``, ``eval``, ...) is refused unrun.

Files already on disk are validated by format (magic numbers, sizes, shapes, label range),
not by checksum, so users may bring their own subsets. Missing files are fetched only when
asked (``download=True``) from the standard mirrors and verified against the published MD5
checksums; otherwise the network is never touched. Every problem is a :class:`DataError`
naming the file.
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
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from fedlap_privacy.data.npz_reader import LIMITS
from fedlap_privacy.errors import DataError, MissingDataError
from fedlap_privacy.state.atomic import atomic_file

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
# The published sizes of those files in bytes (a dry run says what it would fetch).
SIZES: dict[str, dict[str, int]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": 9_912_422,
        "train-labels-idx1-ubyte.gz": 28_881,
        "t10k-images-idx3-ubyte.gz": 1_648_877,
        "t10k-labels-idx1-ubyte.gz": 4_542,
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": 26_421_880,
        "train-labels-idx1-ubyte.gz": 29_515,
        "t10k-images-idx3-ubyte.gz": 4_422_102,
        "t10k-labels-idx1-ubyte.gz": 5_148,
    },
    "cifar10": {CIFAR_ARCHIVE: 170_498_071},
}
_DOWNLOAD_TIMEOUT_S = 60
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Download:
    """One file a run would fetch: from ``url`` into ``target``, ``size`` bytes."""

    url: str
    target: Path
    size: int


def missing_downloads(name: str, root: Path) -> list[Download]:
    """The files ``load_dataset(name, root, download=True)`` would fetch (none when every
    file is present, or for a dataset nothing is downloaded for), without touching the
    network."""
    if name not in MIRRORS:
        return []
    if name == "cifar10":
        names = (*CIFAR_TRAIN, CIFAR_TEST)
        if any(all((folder / n).is_file() for n in names) for folder in (root / CIFAR_DIR, root)):
            return []
        wanted = [CIFAR_ARCHIVE] if not (root / CIFAR_ARCHIVE).is_file() else []
    else:
        wanted = [f"{stem}.gz" for stem in IDX_FILES
                  if not (root / stem).is_file() and not (root / f"{stem}.gz").is_file()]
    return [Download(MIRRORS[name] + file, root / file, SIZES[name][file]) for file in wanted]


def idx_path(name: str, root: Path, stem: str, download: bool) -> Path:
    """The raw file if present, else the gzipped one, else download it (or fail)."""
    for path in (root / stem, root / f"{stem}.gz"):
        if path.is_file():
            return path
    target = root / f"{stem}.gz"
    if not download:
        raise MissingDataError(
            f"missing dataset file {target} (or {root / stem}); fetch it with --download"
        )
    _download(MIRRORS[name] + target.name, target, CHECKSUMS[name][target.name])
    return target


def read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
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
            if count > LIMITS.member_bytes:
                raise DataError(f"{path}: dimensions {dims} declare {count:,} bytes, above the "
                                f"limit of {LIMITS.member_bytes:,} (docs/own-data.md#limits)")
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
    :func:`fedlap_privacy.data.user_data.load_records`'s, which calls this."""
    x = read_idx(images, IDX_IMAGE_MAGIC, ndim=3).astype(np.float32)[:, None] / 255.0
    y = read_idx(labels, IDX_LABEL_MAGIC, ndim=1).astype(np.int64)
    if normalise is not None:
        x = (x - normalise[0]) / normalise[1]
    return x, y


def _read_at_most(f: IO[bytes], limit: int) -> bytes:
    """Read up to ``limit`` bytes in chunks (no up-front allocation from a forged header)."""
    parts, size = [], 0
    while size < limit and (chunk := f.read(min(_CHUNK, limit - size))):
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)




def cifar_folder(root: Path, download: bool) -> Path:
    names = (*CIFAR_TRAIN, CIFAR_TEST)
    for folder in (root / CIFAR_DIR, root):
        if all((folder / name).is_file() for name in names):
            return folder
    folder = root / CIFAR_DIR if (root / CIFAR_DIR).is_dir() else root
    if not download:
        missing = next(folder / name for name in names if not (folder / name).is_file())
        raise MissingDataError(
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


def read_cifar_batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 batch: ``(N, 3, 32, 32)`` uint8 images and int64 labels in
    ``0..num_classes - 1``."""
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
    if (bad := y[(y < 0) | (y >= num_classes)]).size:
        raise DataError(f"{path}: label {int(bad[0])} is out of range 0..{num_classes - 1}")
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
