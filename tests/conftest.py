"""Shared fixtures (applies to every folder below tests/); plain helpers such as the tiny
training configuration ``TINY`` / ``tiny()`` live in helpers.py."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

# the tests compare runs bit for bit: a thread count that follows the machine's load would
# round differently from one run to the next (tests/core/compute/test_threads.py turns it on)
os.environ["FEDLAP_FOLLOW_LOAD"] = "0"


def pytest_configure() -> None:
    """``make test`` runs one pytest-xdist worker per core (``-n auto``, a test file per
    worker): each worker is one of that many processes sharing the cores, so it runs torch on
    one thread, and the commands it starts take their share of the cores (``FEDLAP_WORKERS``,
    :mod:`fedlap_privacy.compute.threads`) instead of spinning threads on cores another worker
    holds. xdist hands its terminal's width to the workers as ``COLUMNS``, which the CLI's console
    (made at import) would keep: the tests see no terminal, as without xdist."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    os.environ.setdefault("FEDLAP_WORKERS", workers)
    os.environ.pop("COLUMNS", None)
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fast_paths_from_the_environment() -> Iterator[None]:
    """The fast-path switches are read once and again at a command's start-up: a test that
    runs a command under another environment must not leave its reading to the next."""
    from fedlap_privacy.compute import fast_paths

    yield
    fast_paths.refresh()


def write_mini_mnist(folder: Path, n_train: int = 200, n_test: int = 50, seed: int = 1) -> Path:
    """MNIST's four IDX files (uncompressed) with random 28x28 images, labels 0..9 in turn."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">4i", 2051, n, 28, 28) + images.tobytes())
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">2i", 2049, n) + labels.tobytes())
    return folder


@pytest.fixture
def mini_mnist(tmp_path: Path) -> Callable[..., Path]:
    """Writes miniature MNIST files into a folder under ``tmp_path``; returns the folder."""

    def make(name: str = "mnist", **kw: int) -> Path:
        return write_mini_mnist(tmp_path / name, **kw)

    return make

