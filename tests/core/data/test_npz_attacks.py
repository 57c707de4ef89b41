"""Forged ``.npz`` archives as an attacker would hand them over (issue 46, item 4): each one
is refused in one line naming the file, before anything large is allocated, by the one
reader of ``train --data``, ``audit --members`` and a Flower node's ``data-file``
(:mod:`fedlap_privacy.data.npz_reader`). Every test here failed on the reader before it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from npz_forge import npy_bytes, npy_header, records, stored, write_zip, zero_bomb
from user_records import blobs, tabular_folder

from fedlap_privacy.data.user_data import load_records, load_user_data, probe
from fedlap_privacy.errors import DataError


def _one_line(error: pytest.ExceptionInfo[DataError], *words: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def test_float64_beyond_float32_is_refused_after_the_cast(tmp_path: Path) -> None:
    """3.5e38 is finite in float64 and inf in float32: it used to train NaN weights."""
    root = tmp_path / "d"
    root.mkdir()
    for k in range(3):
        x, y = blobs(20, k)
        x = x.astype(np.float64)
        if k == 1:
            x[5, 2] = 3.5e38
        np.savez(root / f"site{k}.npz", x=x, y=y)
    with pytest.raises(DataError) as error:
        load_user_data(root)
    _one_line(error, "site1.npz", "record 5", "float32")
    with pytest.raises(DataError) as error:
        load_records(root / "site1.npz")
    _one_line(error, "site1.npz", "record 5")
    np.savez(root / "site1.npz", x=blobs(20, 1)[0].astype(np.float64) * 1e30, y=blobs(20, 1)[1])
    assert np.isfinite(load_user_data(root).x_train).all()  # large but finite: kept


@pytest.mark.parametrize("names", [("x.npy", "x.npy"), ("x", "x.npy")])
def test_duplicate_members_are_refused(tmp_path: Path, names: tuple[str, str]) -> None:
    """The checked header and the array read came from two different members: complex or
    datetime features read past a float32 header."""
    x, y = blobs(20, 0)
    hidden = (x + 1j).astype(np.complex64) if names[0] == names[1] else \
        np.zeros((20, 6), "datetime64[s]")
    path = write_zip(tmp_path / "dup.npz", [stored(names[0], npy_bytes(hidden)),
                                            stored(names[1], npy_bytes(x)),
                                            stored("y.npy", npy_bytes(y))])
    with pytest.raises(DataError) as error:
        load_records(path)
    _one_line(error, "dup.npz", "'x'", "twice")
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "dup.npz", "twice")


@pytest.mark.parametrize("member", ["notes.txt", "extra.npy", "sub/x.npy"])
def test_members_other_than_the_records_arrays_are_refused(tmp_path: Path, member: str) -> None:
    x, y = blobs(20, 0)
    path = write_zip(tmp_path / "odd.npz", [stored("x.npy", npy_bytes(x)),
                                            stored("y.npy", npy_bytes(y)),
                                            stored(member, npy_bytes(y))])
    with pytest.raises(DataError) as error:
        load_records(path)
    _one_line(error, "odd.npz", repr(member))


def test_a_zip_directory_of_thousands_of_entries_is_refused_unparsed(tmp_path: Path) -> None:
    """x and y beside 3,000 empty entries (a directory that grows with the file, parsed
    whole by zipfile): refused from the end record's counts."""
    x, y = blobs(20, 0)
    path = write_zip(tmp_path / "many.npz", [stored("x.npy", npy_bytes(x)),
                                             stored("y.npy", npy_bytes(y)),
                                             *(stored(f"pad{k}", b"") for k in range(3000))])
    with pytest.raises(DataError) as error:
        load_records(path)
    _one_line(error, "many.npz", "3,002 entries")


def test_a_zip_bomb_is_refused_before_it_is_decompressed(tmp_path: Path) -> None:
    """1.3 MB on disk, 1.25 GiB of float32 zeros once inflated (it used to be read whole)."""
    n, d = 327_680, 1024
    bomb = zero_bomb("x.npy", npy_header((n, d)), n * d * 4)
    labels = stored("y.npy", npy_bytes((np.arange(n) % 2).astype(np.uint8)))
    path = write_zip(tmp_path / "bomb.npz", [bomb, labels])
    assert path.stat().st_size < 2_000_000
    with pytest.raises(DataError) as error:
        load_records(path)
    _one_line(error, "bomb.npz", "'x'", "1,342,177,280 bytes")
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "bomb.npz", "1,342,177,280 bytes")


@pytest.mark.parametrize("how", ["declared", "labels"])
def test_a_hundred_million_classes_are_refused_before_the_model(tmp_path: Path, how: str) -> None:
    """A 1e8-class head would take 25.6 GB: refused by the layout, which builds no model."""
    x, y = blobs(20, 0)
    if how == "declared":
        path = records(tmp_path / "classes.npz", x, y, num_classes=np.array(100_000_000))
    else:
        path = records(tmp_path / "classes.npz", x, np.where(y == 2, 99_999_999, y))
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "classes.npz", "classes")
    with pytest.raises(DataError) as error:
        load_records(path)
    _one_line(error, "classes.npz", "classes")


@pytest.mark.parametrize("shape", [(2, 1, 40_000, 40_000), (2, 40_000_000)])
def test_a_header_asking_for_gigabytes_is_refused_before_the_model(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """A few hundred bytes whose x header declares 40,000-pixel images or 4e7 features: the
    model used to be built for that shape from the header alone (10 GB, or a traceback)."""
    y = np.array([0, 1])
    path = write_zip(tmp_path / "tiny.npz", [stored("x.npy", npy_header(shape, "|u1")),
                                             stored("y.npy", npy_bytes(y))])
    assert path.stat().st_size < 600
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "tiny.npz", "'x'")


@pytest.mark.parametrize(("shape", "word"), [((2, 70_000), "features"),
                                             ((2, 1, 1100, 1100), "1100"),
                                             ((2, 300, 4, 4), "channels")])
def test_records_beyond_the_bounds_are_refused_from_their_header(
    tmp_path: Path, shape: tuple[int, ...], word: str
) -> None:
    """Well-formed archives whose records exceed the documented bounds (docs/own-data.md)."""
    path = records(tmp_path / "wide.npz", np.zeros(shape, np.uint8), np.array([0, 1]))
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "wide.npz", word)


def test_a_client_id_of_a_billion_is_refused_before_counting(tmp_path: Path) -> None:
    """Counting the records per id used to allocate one counter per id up to the largest:
    8 GB for an id of 1e9 in a 20-record file."""
    x, y = blobs(20, 0)
    path = records(tmp_path / "ids.npz", x, y, client=np.array([0] * 19 + [10**9]))
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "ids.npz", "1,000,000,000", "clients")


def test_large_images_with_many_classes_are_refused_before_the_model(tmp_path: Path) -> None:
    """1024x1024 images and 100 classes, each within its bound: the default ConvNet's last
    layer would hold 210 million weights (840 MB) for two records."""
    x = np.zeros((2, 1, 1024, 1024), np.uint8)
    path = records(tmp_path / "big.npz", x, np.array([0, 1]), num_classes=np.array(100))
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "big.npz", "1024x1024 with 100 classes")


def test_an_idx_pair_declaring_gigabytes_is_refused_from_its_header(tmp_path: Path) -> None:
    """audit's IMAGES,LABELS: a gzipped IDX header declaring 2,000 images of 1024x1024 is
    refused before its body is inflated (the body used to be read up to the declared size)."""
    import gzip
    import struct

    with gzip.open(tmp_path / "images.gz", "wb") as f:
        f.write(struct.pack(">4i", 2051, 2000, 1024, 1024) + bytes(1 << 16))
    with gzip.open(tmp_path / "labels.gz", "wb") as f:
        f.write(struct.pack(">2i", 2049, 2000) + bytes(2000))
    with pytest.raises(DataError) as error:
        load_records(f"{tmp_path / 'images.gz'},{tmp_path / 'labels.gz'}")
    _one_line(error, "images.gz", "2,097,152,000 bytes", "limit")


def _outside(tmp_path: Path) -> Path:
    x, y = blobs(20, 5)
    np.savez(tmp_path / "secret.npz", x=x, y=y)
    return tmp_path / "secret.npz"


@pytest.mark.parametrize("kind", ["broken-link", "directory", "fifo", "outside-link"])
def test_a_client_entry_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """c.npz used to be dropped silently (2 of 3 clients trained) or followed out of the
    folder; now it is one line naming it."""
    root = tabular_folder(tmp_path / "d", sizes=(20, 20), test=0)
    entry = root / "c.npz"
    if kind == "broken-link":
        entry.symlink_to(root / "gone.npz")
    elif kind == "directory":
        entry.mkdir()
    elif kind == "fifo":
        os.mkfifo(entry)
    else:
        entry.symlink_to(_outside(tmp_path))
    with pytest.raises(DataError) as error:
        probe(root)
    _one_line(error, str(entry))
    with pytest.raises(DataError) as error:
        load_user_data(root)
    _one_line(error, str(entry))


def test_a_link_inside_the_folder_is_a_client(tmp_path: Path) -> None:
    """The documented policy: a link to a regular file in the same folder is read."""
    root = tabular_folder(tmp_path / "d", sizes=(20, 30), test=0)
    (root / "site2.npz").symlink_to("site1.npz")
    assert probe(root).sizes == (20, 30, 30)


def test_a_fifo_as_one_partys_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "node.npz")
    with pytest.raises(DataError) as error:
        load_records(tmp_path / "node.npz")
    _one_line(error, "node.npz", "not a regular file")


@pytest.mark.parametrize("shape", [(-40, -6), (-40, -1, 2, 3)], ids=["rows", "images"])
def test_a_negative_dimension_is_refused_from_its_header(tmp_path: Path,
                                                         shape: tuple[int, ...]) -> None:
    """Two negative dimensions multiply to the true byte count, so the size check passed and
    the shape reached the record checks (``x (-40)`` in their messages)."""
    x, y = blobs(40, 0)
    path = write_zip(tmp_path / "neg.npz", [stored("x.npy", npy_header(shape) + x.tobytes()),
                                            stored("y.npy", npy_bytes(y))])
    with pytest.raises(DataError) as error:
        probe(path)
    _one_line(error, "neg.npz", f"declares shape {shape}", "negative dimension")
