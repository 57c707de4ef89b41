"""The canary-score file of ``fedlap-privacy audit --canary-scores FILE.npz``, read strictly.

The file is an ``.npz`` archive (``np.savez(FILE, scores=..., included=...)``, compressed or
not) holding exactly what a one-run audit needs: ``scores`` (one real number per canary,
higher = more likely included) and ``included`` (the secret bits: booleans, or integers 0 and
1). It comes from someone else's training, so it is untrusted: nothing is unpickled (an
object array is refused from its header, before any of its bytes are read), the header is
not trusted (a declared shape must be 1-D, at most :data:`MAX_CANARIES` long and match the
bytes the member holds), and no member is decompressed beyond the bytes its header declares
(a zip bomb reads no further than that). Other members are ignored. Every problem is one
:class:`~fedlap_privacy.errors.DataError` line naming the file.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np

from fedlap_privacy.audit.score_audit import check_bits, check_scores
from fedlap_privacy.errors import ConfigError, DataError

__all__ = ["MAX_CANARIES", "MAX_FILE_BYTES", "load_score_file"]

#: most canaries a score file may hold (each a float64 score and a bit)
MAX_CANARIES = 10_000_000
#: largest score file read (bytes on disk)
MAX_FILE_BYTES = 256 * 2**20
_KINDS = {"scores": "fiu", "included": "biu"}
_CHUNK = 1 << 20


def _read_exactly(f: IO[bytes], size: int) -> bytes:
    """At most ``size + 1`` bytes, in chunks (one byte more reveals a member longer than
    its header)."""
    parts, got = [], 0
    while got <= size and (chunk := f.read(min(_CHUNK, size + 1 - got))):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _member(path: Path, archive: zipfile.ZipFile, key: str) -> np.ndarray:
    info = next((i for i in archive.infolist() if i.filename == f"{key}.npy"), None)
    if info is None:
        names = sorted(i.filename.removesuffix(".npy") for i in archive.infolist())
        raise DataError(f"{path}: needs arrays 'scores' and 'included' (np.savez(FILE, "
                        f"scores=..., included=...)); it holds {names or 'nothing'}")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise DataError(f"{path}: array {key!r} has .npy format {version}")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(f)
        if dtype.hasobject:
            raise DataError(f"{path}: array {key!r} holds Python objects (a pickle); nothing "
                            "was unpickled: save plain numbers")
        if len(shape) != 1:
            raise DataError(f"{path}: array {key!r} must be 1-D (one value per canary), got "
                            f"shape {shape}")
        if dtype.kind not in _KINDS[key] or dtype.fields is not None:
            want = "real numbers" if key == "scores" else "booleans or the integers 0 and 1"
            raise DataError(f"{path}: array {key!r} must hold {want}, got dtype {dtype}")
        if shape[0] > MAX_CANARIES:
            raise DataError(f"{path}: array {key!r} declares {shape[0]:,} canaries, more than "
                            f"the {MAX_CANARIES:,} a score file may hold")
        size = math.prod(shape) * dtype.itemsize
        body = _read_exactly(f, size)
    if len(body) != size:
        raise DataError(f"{path}: array {key!r} declares shape {shape} ({size:,} bytes) but "
                        f"holds {'more' if len(body) > size else f'{len(body):,}'}: the file "
                        "is truncated or forged")
    return np.frombuffer(body, dtype).reshape(shape, order="F" if fortran else "C")


def load_score_file(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, included)`` of a canary-score file (module docstring): float64 scores, all
    finite, and boolean bits of the same length; a one-line DataError otherwise."""
    path = Path(path)
    try:
        if not path.is_file():
            raise DataError(f"no canary-score file at {path}")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"{path}: {path.stat().st_size:,} bytes, more than the "
                            f"{MAX_FILE_BYTES:,} a canary-score file may have")
        if not zipfile.is_zipfile(path):
            raise DataError(f"{path}: not an .npz archive (write it with np.savez(FILE, "
                            "scores=..., included=...))")
        with zipfile.ZipFile(path) as archive:
            scores = _member(path, archive, "scores")
            bits = _member(path, archive, "included")
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise DataError(f"cannot read {path} as .npz: {str(exc)[:160]}") from None
    try:
        values = check_scores(scores)
        return values, check_bits(bits, len(values))
    except ConfigError as exc:
        raise DataError(f"{path}: {exc}") from None
