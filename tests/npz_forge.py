"""Forged ``.npz`` archives for the attacker's tests (issue 46, item 4): written byte by byte,
so that a test can put in a zip what ``np.savez`` never would (plain helpers)."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

STORED, DEFLATED = 0, 8
_DOS_DATE = 0x21  # 1980-01-01


@dataclass(frozen=True)
class Entry:
    """One zip member as it goes on disk: its name, its bytes as stored and what they
    decompress to (size and CRC-32)."""

    name: str
    data: bytes
    method: int
    size: int
    crc: int


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as an ``.npy`` file."""
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f4", fortran: bool = False) -> bytes:
    """An ``.npy`` header alone (magic, version 1.0, dict), declaring ``shape`` of ``descr``
    (stored in Fortran order with ``fortran``)."""
    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return out.getvalue()


def stored(name: str, body: bytes) -> Entry:
    return Entry(name, body, STORED, len(body), zlib.crc32(body))


def zero_bomb(name: str, header: bytes, zeros: int) -> Entry:
    """``header`` then ``zeros`` zero bytes, deflated to about 1/1000 of that (the same
    full-flushed block of 1 MiB repeated), with the true CRC: a well-formed zip bomb."""
    chunk = 1 << 20
    assert zeros % chunk == 0
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = deflate.compress(header) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(bytes(chunk)) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header)
    zero = bytes(chunk)
    for _ in range(zeros // chunk):
        crc = zlib.crc32(zero, crc)
    data = head + block * (zeros // chunk) + deflate.flush()
    return Entry(name, data, DEFLATED, len(header) + zeros, crc)


def write_zip(path: Path, entries: list[Entry]) -> Path:
    """A zip of ``entries`` in that order, duplicates and all (no zip64: under 4 GiB)."""
    body, directory = io.BytesIO(), io.BytesIO()
    for e in entries:
        name = e.name.encode()
        offset = body.tell()
        body.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, e.method, 0, _DOS_DATE,
                               e.crc, len(e.data), e.size, len(name), 0))
        body.write(name + e.data)
        directory.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, e.method, 0,
                                    _DOS_DATE, e.crc, len(e.data), e.size, len(name), 0, 0,
                                    0, 0, 0, offset))
        directory.write(name)
    cd = directory.getvalue()
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(cd),
                      body.tell(), 0)
    path.write_bytes(body.getvalue() + cd + end)
    return path


def records(path: Path, x: np.ndarray, y: np.ndarray, **extra: np.ndarray) -> Path:
    """A plain archive of records, written by :func:`write_zip` (stored members)."""
    arrays = {"x": x, "y": y, **extra}
    return write_zip(path, [stored(f"{k}.npy", npy_bytes(v)) for k, v in arrays.items()])
