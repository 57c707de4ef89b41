"""The canary-score file of ``fedlap-privacy audit --canary-scores FILE.npz``, read strictly.

The file is an ``.npz`` archive (``np.savez(FILE, scores=..., included=...)``, compressed or
not) holding exactly what a one-run audit needs: ``scores`` (one real number per canary,
higher = more likely included) and ``included`` (the secret bits: booleans, or integers 0 and
1). It comes from someone else's training, so it is untrusted: it is read by the package's
one ``.npz`` reader, :mod:`fedlap_privacy.data.npz_reader` (no pickle: an object array is refused
from its header; links, FIFOs, duplicate or other members refused; no member decompressed
beyond the bytes its header declares, which must match what the zip entry holds, within
:data:`MAX_CANARIES` values), and each array's header must then be 1-D, of the right kind
and at most :data:`MAX_CANARIES` long before it is read. Every problem is one
:class:`~fedlap_privacy.errors.DataError` line naming the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from fedlap_privacy.audit.canaries.score_audit import MAX_CANARIES, check_bits, check_scores
from fedlap_privacy.data.npz_reader import NpyHeader, NpzArchive, NpzLimits, open_npz
from fedlap_privacy.errors import ConfigError, DataError

__all__ = ["MAX_CANARIES", "MAX_FILE_BYTES", "load_score_file"]

#: largest score file read (bytes on disk)
MAX_FILE_BYTES = 256 * 2**20
_KINDS = {"scores": "fiu", "included": "biu"}
#: the one reader's bounds for a score file: two arrays of at most MAX_CANARIES values
_LIMITS = NpzLimits(member_bytes=MAX_CANARIES * 8, archive_bytes=MAX_CANARIES * 16)


def _check_header(path: Path, key: str, header: NpyHeader) -> None:
    """What a score file's array must be, from its header (nothing read yet)."""
    shape, dtype = header.shape, header.dtype
    if len(shape) != 1:
        raise DataError(f"{path}: array {key!r} must be 1-D (one value per canary), got "
                        f"shape {shape}")
    if dtype.kind not in _KINDS[key]:
        want = "real numbers" if key == "scores" else "booleans or the integers 0 and 1"
        raise DataError(f"{path}: array {key!r} must hold {want}, got dtype {dtype}")
    if shape[0] > MAX_CANARIES:
        raise DataError(f"{path}: array {key!r} declares {shape[0]:,} canaries, more than "
                        f"the {MAX_CANARIES:,} an audit takes")


def _arrays(path: Path, archive: NpzArchive) -> tuple[np.ndarray, np.ndarray]:
    headers = archive.headers
    if "scores" not in headers or "included" not in headers:
        raise DataError(f"{path}: needs arrays 'scores' and 'included' (np.savez(FILE, "
                        f"scores=..., included=...)); it holds {sorted(headers) or 'nothing'}")
    for key in _KINDS:
        _check_header(path, key, headers[key])
    return archive.read("scores"), archive.read("included")


def load_score_file(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, included)`` of a canary-score file (module docstring): float64 scores, all
    finite, and boolean bits of the same length; a one-line DataError otherwise."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no canary-score file at {path}")
    if path.is_file():  # a friendlier line than the reader's for the common mistakes
        if path.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"{path}: {path.stat().st_size:,} bytes, more than the "
                            f"{MAX_FILE_BYTES:,} a canary-score file may have")
        if not zipfile.is_zipfile(path):
            raise DataError(f"{path}: not an .npz archive (write it with np.savez(FILE, "
                            "scores=..., included=...))")
    with open_npz(path, _KINDS, limits=_LIMITS) as archive:
        scores, bits = _arrays(path, archive)
    try:
        values = check_scores(scores)
        return values, check_bits(bits, len(values))
    except ConfigError as exc:
        raise DataError(f"{path}: {exc}") from None
