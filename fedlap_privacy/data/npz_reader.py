"""The one reader of a user's ``.npz`` archives: ``train --data``, ``audit --members`` /
``--nonmembers`` (and ``--dry-run``), a Flower node's ``data-file`` (docs/own-data.md#limits).

An archive someone else made is untrusted input (docs/threat-model.md): the zip directory,
the ``.npy`` headers and the bytes may all be forged. What this module guarantees, each
refusal one :class:`~fedlap_privacy.errors.DataError` line naming the file:

* the file is opened once, without following a final link (``O_NOFOLLOW``) and without
  blocking (``O_NONBLOCK``: a FIFO never hangs the reader), and read through that one
  descriptor, which must be a regular file. A named file (``--members``, ``data-file``, a
  single ``--data`` file) may be a link the person running the command made; an entry of a
  ``--data`` FOLDER may be a link only to a regular file inside that folder
  (:func:`folder_entries`: a broken link, a link leaving the folder, a directory, a FIFO or
  a device named ``*.npz`` is refused, never skipped);
* the zip directory is bounded (:attr:`NpzLimits.members` entries, no zip64 directory)
  before :mod:`zipfile` parses it; every member is ``NAME.npy`` with NAME among the arrays
  the caller expects, each at most once (``x.npy`` twice, or ``x`` beside ``x.npy``, is
  refused: the header checked would not be the array read), neither encrypted nor
  compressed other than stored or deflated;
* every member's ``.npy`` header (read with numpy's bounded header parser, never a pickle:
  object, complex, datetime, structured and string dtypes are refused) must declare exactly
  the bytes the zip entry says it decompresses to, and those bytes must fit
  :attr:`NpzLimits.member_bytes` (each array) and :attr:`NpzLimits.archive_bytes` (all of
  them): a zip bomb is refused from its headers, before anything is inflated;
* :meth:`NpzArchive.read` inflates one member into an array allocated at its (checked) size
  and refuses a member that holds fewer or more bytes, or fails its CRC;
  :meth:`NpzArchive.read_rows` (C order) and :meth:`NpzArchive.read_columns` (Fortran order,
  which the file's author chooses) read it in bounded blocks under the same checks.

What the records may hold (features, image size, classes, records, clients: the rest of
:class:`NpzLimits`) is checked from these headers by :mod:`fedlap_privacy.data.user_data` before
any model is built or any feature read.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

import numpy as np

from fedlap_privacy.errors import DataError

__all__ = ["LIMITS", "ColumnBlock", "NpyHeader", "NpzArchive", "NpzLimits", "folder_entries",
           "open_npz"]

_GiB = 1 << 30
_CHUNK = 1 << 20
_BLOCK = 4 << 20  # bytes of one block of rows (NpzArchive.read_rows)
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD_SIZE = 22
_NUMBERS = "biuf"  # bool, signed and unsigned integers, floats
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX flags (absent on Windows)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class NpzLimits:
    """The bounds of a user's records (docs/own-data.md#limits): one place, checked from
    the headers before anything they describe is allocated. Fixed numbers rather than a
    share of this machine's memory, so that a file accepted on one machine (one Flower
    node) is accepted on every other one."""

    #: decompressed bytes of one ``.npy`` array (a zip bomb is refused from its header)
    member_bytes: int = _GiB
    #: decompressed bytes of all the arrays of one archive
    archive_bytes: int = _GiB
    #: the features of every file of a run (or of one party's file) once read as float32
    data_bytes: int = _GiB
    #: entries in one archive's zip directory (x, y, num_classes, client)
    members: int = 8
    #: bytes of one archive's zip directory
    directory_bytes: int = 64 << 10
    #: records in one file
    records: int = 50_000_000
    #: features of a record (tabular x of shape (N, D))
    features: int = 65_536
    #: height and width of an image (x of shape (N, C, H, W))
    image_side: int = 1024
    #: channels of an image
    channels: int = 64
    #: classes of a run (num_classes, or one more than the largest label)
    classes: int = 10_000
    #: image height x width x classes: the default ConvNet's last layer has about twice as
    #: many weights (its width over 4 per block, times the pixels and the classes)
    image_classes: int = 1 << 25
    #: clients of one file with a ``client`` array, or ``.npz`` files in one folder
    clients: int = 100_000


#: the limits every entry point reads under
LIMITS = NpzLimits()


@dataclass(frozen=True)
class NpyHeader:
    """What an ``.npy`` member's header says, read without its data."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """The bytes of the array it declares (Python integers: no overflow)."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ColumnBlock:
    """A block of :meth:`NpzArchive.read_columns`: ``values[i, j]`` is the value of record
    ``first_record + i`` at position ``first_position + j`` of the record's values numbered
    in Fortran order of the record's shape."""

    first_record: int
    first_position: int
    values: np.ndarray


@dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    header: NpyHeader
    fortran: bool


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return what
    return "not a file"


def _not_regular(path: Path, mode: int) -> DataError:
    return DataError(f"{path} is not a regular file ({_kind(mode)}): an .npz of records must "
                     "be a plain file")


def _open_fd(path: Path, folder: Path | None) -> int:
    """A descriptor of the regular file at ``path`` (module docstring: links and folders)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"no such file: {path}") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    target, link = path, stat.S_ISLNK(mode)
    if link:
        if folder is not None:
            real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
            if not real.is_relative_to(root):
                raise DataError(f"{path} is a link to {real}, outside {folder}: copy the file "
                                "into the folder (links may only point inside it)")
            target = real
    elif not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    nofollow = 0 if link and folder is None else _NOFOLLOW  # a link named by the user
    try:
        fd = os.open(target, os.O_RDONLY | _NONBLOCK | _CLOEXEC | nofollow)
    except FileNotFoundError:
        raise DataError(f"{path} is a link to {target}, which does not exist") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    return fd


def folder_entries(folder: Path, limits: NpzLimits = LIMITS) -> list[Path]:
    """The ``*.npz`` entries of a ``--data`` folder, sorted by name, each a regular file or a
    link to one inside the folder (checked again when it is opened: :func:`open_npz`)."""
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.name.endswith(".npz"))
    except OSError as exc:
        raise DataError(f"cannot list {folder}: {exc.strerror}") from None
    if len(names) > limits.clients + 1:
        raise DataError(f"{folder} holds {len(names):,} .npz files, more than the "
                        f"{limits.clients:,} clients a run may have (docs/own-data.md#limits)")
    for name in names:
        os.close(_open_fd(folder / name, folder))
    return [folder / name for name in names]


def _directory(f: IO[bytes], size: int, path: Path, limits: NpzLimits) -> None:
    """Bound the zip directory from its end record, as :mod:`zipfile` finds it, before
    :mod:`zipfile` parses it (a directory of millions of entries would fill the memory)."""
    tail_size = min(size, _EOCD_SIZE + 0xFFFF)
    f.seek(size - tail_size)
    tail = f.read(tail_size)
    at = len(tail) - _EOCD_SIZE
    if not (at >= 0 and tail[at:at + 4] == _EOCD and tail[-2:] == b"\0\0"):
        at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < _EOCD_SIZE:
        raise DataError(f"cannot read {path} as .npz: not a zip archive")
    end = size - tail_size + at  # where the end record starts in the file
    f.seek(max(end - 20, 0))
    if end >= 20 and f.read(4) == _EOCD64_LOCATOR:  # where zipfile looks for one
        raise DataError(f"{path}: a zip64 directory, which only archives beyond the limits "
                        "need (docs/own-data.md#limits)")
    entries, directory = struct.unpack("<4s4H2LH", tail[at:at + _EOCD_SIZE])[4:6]
    if entries > limits.members or directory > limits.directory_bytes:
        raise DataError(f"{path}: a zip directory of {entries:,} entries ({directory:,} bytes); "
                        f"an .npz of records holds at most {limits.members} arrays")


def _header(f: IO[bytes], path: Path, name: str) -> tuple[NpyHeader, bool]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise DataError(f"{path}: array {name!r} has .npy format {version}; expected 1.0 or 2.0")
    if dtype.hasobject:
        raise DataError(f"{path}: array {name!r} holds Python objects (a pickle), which is "
                        "never loaded; save plain numbers")
    if dtype.kind not in _NUMBERS or dtype.fields is not None or dtype.subdtype is not None:
        raise DataError(f"{path}: array {name!r} has dtype {dtype}; expected plain numbers "
                        "(integers or floats)")
    if any(int(d) < 0 for d in shape):
        raise DataError(f"{path}: array {name!r} declares shape {tuple(shape)}, with a "
                        "negative dimension: the file is forged")
    return NpyHeader(tuple(int(d) for d in shape), dtype), bool(fortran)


class NpzArchive:
    """An opened ``.npz`` whose directory and headers passed the module's checks; arrays are
    read one at a time with :meth:`read`. Use it as a context manager (:func:`open_npz`)."""

    def __init__(self, path: Path, f: IO[bytes], allowed: Iterable[str],
                 required: Iterable[str], limits: NpzLimits) -> None:
        self.path = path
        self._file = f
        size = os.fstat(f.fileno()).st_size
        _directory(f, size, path, limits)
        f.seek(0)
        self._zip = zipfile.ZipFile(f)
        self._members = self._check_members(tuple(allowed), tuple(required), limits)

    @property
    def headers(self) -> dict[str, NpyHeader]:
        """Each array's header, by name (``x``, not ``x.npy``)."""
        return {name: member.header for name, member in self._members.items()}

    def _check_members(self, allowed: tuple[str, ...], required: tuple[str, ...],
                       limits: NpzLimits) -> dict[str, _Member]:
        path = self.path
        infos = self._zip.infolist()
        if len(infos) > limits.members:
            raise DataError(f"{path}: {len(infos)} zip entries; an .npz of records holds at "
                            f"most {limits.members} arrays")
        seen: dict[str, str] = {}
        for info in infos:
            base = info.filename.removesuffix(".npy")
            if base in seen:
                raise DataError(f"{path}: holds array {base!r} twice ({seen[base]!r} and "
                                f"{info.filename!r}); save each array once")
            seen[base] = info.filename
        if missing := [name for name in required if name not in seen]:
            raise DataError(f"{path}: an .npz of records needs arrays "
                            f"{' and '.join(map(repr, required))} (missing {', '.join(missing)})")
        members: dict[str, _Member] = {}
        total = 0
        for info in infos:
            name = info.filename.removesuffix(".npy")
            if not info.filename.endswith(".npy") or name not in allowed:
                raise DataError(f"{path}: member {info.filename!r} is not one of the arrays "
                                f"{', '.join(allowed)} (as NAME.npy)")
            if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED,
                                                                  zipfile.ZIP_DEFLATED):
                raise DataError(f"{path}: array {name!r} is encrypted or compressed with "
                                f"method {info.compress_type}; np.savez or np.savez_compressed "
                                "write what is read")
            members[name] = member = self._member(info, name, limits)
            total += member.header.nbytes
            if total > limits.archive_bytes:
                raise DataError(f"{path}: its arrays would decompress to more than "
                                f"{limits.archive_bytes:,} bytes, the limit of one archive "
                                "(docs/own-data.md#limits)")
        return members

    def _member(self, info: zipfile.ZipInfo, name: str, limits: NpzLimits) -> _Member:
        path = self.path
        try:
            with self._zip.open(info) as f:
                header, fortran = _header(f, path, name)
                offset = f.tell()
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DataError(f"cannot read {path} as .npz: {str(exc)[:120]}") from None
        size = header.nbytes
        if offset + size != info.file_size:
            raise DataError(f"{path}: array {name!r} declares shape {header.shape} "
                            f"({size:,} bytes) but holds {info.file_size - offset:,}: the file "
                            "is truncated or forged")
        if size > limits.member_bytes:
            raise DataError(f"{path}: array {name!r} would decompress to {size:,} bytes "
                            f"({header.dtype} {header.shape}), above the limit of "
                            f"{limits.member_bytes:,} bytes per array (docs/own-data.md#limits)")
        return _Member(info, header, fortran)

    def _member_named(self, name: str) -> _Member:
        member = self._members.get(name)
        if member is None:
            raise DataError(f"{self.path}: no array {name!r}")
        return member

    def _size_error(self, name: str, header: NpyHeader, got: int | None) -> DataError:
        """A member holding ``got`` bytes (None: more) rather than its header's."""
        return DataError(f"{self.path}: array {name!r} declares shape {header.shape} "
                         f"({header.nbytes:,} bytes) but holds "
                         f"{'more' if got is None else f'{got:,}'}: the file is truncated or "
                         "forged")

    def read(self, name: str) -> np.ndarray:
        """Array ``name``, inflated into an array of its checked size; a member that holds
        fewer or more bytes than its header declares, or fails its CRC, is refused."""
        member = self._member_named(name)
        header = member.header
        out = np.empty(math.prod(header.shape), header.dtype)
        view = memoryview(out.view(np.uint8))
        done = 0
        try:
            with self._zip.open(member.info) as f:
                _header(f, self.path, name)
                while done < len(view) and (got := f.readinto(view[done:done + _CHUNK])):
                    done += got
                extra = f.read(1)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DataError(f"cannot read {self.path} as .npz: {str(exc)[:120]}") from None
        if done != len(view) or extra:
            raise self._size_error(name, header, None if extra else done)
        return out.reshape(header.shape, order="F" if member.fortran else "C")

    def fortran(self, name: str) -> bool:
        """Whether array ``name`` is stored in Fortran order (its header's ``fortran_order``,
        which the file's author chooses): its first axis varies fastest in the bytes."""
        return self._member_named(name).fortran

    def _stream(self, name: str, counts: Iterable[int]) -> Iterator[np.ndarray]:
        """Array ``name``'s values in file order, as fresh flat arrays of ``counts`` values
        each (together exactly the array's), under the checks of :meth:`read`: a member
        holding fewer bytes is refused at the block that misses them, one holding more (or
        failing its CRC) after the last block."""
        member = self._member_named(name)
        header = member.header
        read = 0
        try:
            with self._zip.open(member.info) as f:
                _header(f, self.path, name)
                for count in counts:
                    out = np.empty(count, header.dtype)
                    view = memoryview(out.view(np.uint8))
                    done = 0
                    while done < len(view) and (got := f.readinto(view[done:done + _CHUNK])):
                        done += got
                    if done != len(view):
                        raise self._size_error(name, header, read + done)
                    read += done
                    yield out
                if f.read(1):
                    raise self._size_error(name, header, None)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise DataError(f"cannot read {self.path} as .npz: {str(exc)[:120]}") from None

    def read_rows(self, name: str, block_bytes: int | None = None) -> Iterator[np.ndarray]:
        """Array ``name`` (stored in C order) in consecutive blocks along its first axis,
        each a fresh array of about ``block_bytes`` (None: 4 MiB; at least one row), under
        the checks of :meth:`read` (the last block is followed by the member's end and its
        CRC): a caller that casts or scatters the rows holds one block beside what it fills,
        never the whole array twice. A Fortran-order member is read with :meth:`read_columns`; here,
        like a 0-d one, it comes as one block, read whole."""
        member = self._member_named(name)
        header = member.header
        if member.fortran or not header.shape:
            yield self.read(name)
            return
        block_bytes = _BLOCK if block_bytes is None else block_bytes
        rows, row_shape = header.shape[0], header.shape[1:]
        row_values = math.prod(row_shape)
        per = max(1, block_bytes // max(row_values * header.dtype.itemsize, 1))
        counts = (min(per, rows - start) * row_values for start in range(0, rows, per))
        for block in self._stream(name, counts):
            yield block.reshape(-1, *row_shape)

    def read_columns(self, name: str, block_bytes: int | None = None) -> Iterator[ColumnBlock]:
        """Array ``name``, stored in Fortran order (its first axis varies fastest, so that
        reading it by rows would need it whole: :meth:`fortran`) and at least 1-d, in
        consecutive stretches of its bytes of about ``block_bytes`` (None: 4 MiB), under the
        checks of :meth:`read`. A record's values are numbered in Fortran order of the
        record's shape (``shape[1:]``); a block holds whole columns (every record's values at
        consecutive positions) or, when one column of records exceeds ``block_bytes``, a run
        of records at one position."""
        member = self._member_named(name)
        header = member.header
        block_bytes = _BLOCK if block_bytes is None else block_bytes
        records, positions = header.shape[0], math.prod(header.shape[1:])
        column = max(records * header.dtype.itemsize, 1)
        if column <= block_bytes:  # whole columns
            per = block_bytes // column
            spans = [(0, records, start, min(start + per, positions))
                     for start in range(0, positions, per)]
        else:  # runs of records of one column
            per = max(1, block_bytes // header.dtype.itemsize)
            spans = [(start, min(start + per, records), at, at + 1)
                     for at in range(positions) for start in range(0, records, per)]
        counts = ((r1 - r0) * (p1 - p0) for r0, r1, p0, p1 in spans)
        where = iter(spans)  # the stream runs to its end: its size and CRC checks
        for block in self._stream(name, counts):
            r0, r1, p0, p1 = next(where)
            yield ColumnBlock(r0, p0, block.reshape(p1 - p0, r1 - r0).T)

    def close(self) -> None:
        self._zip.close()
        self._file.close()

    def __enter__(self) -> NpzArchive:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def open_npz(path: Path, allowed: Iterable[str], required: Iterable[str] = (),
             folder: Path | None = None, limits: NpzLimits = LIMITS) -> NpzArchive:
    """``path`` opened and checked (module docstring); ``allowed``: the array names it may
    hold, ``required`` those it must; ``folder``: the ``--data`` folder it is an entry of
    (links only inside it)."""
    fd = _open_fd(path, folder)
    f = os.fdopen(fd, "rb")
    try:
        return NpzArchive(path, f, allowed, required, limits)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, zlib.error) as exc:
        f.close()
        raise DataError(f"cannot read {path} as .npz: {str(exc)[:120]}") from None
    except BaseException:
        f.close()
        raise
