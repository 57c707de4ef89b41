"""Atomic, link-safe file writes: the one way this package writes a file into a run folder.

:func:`write_atomic` writes the bytes into a fresh temporary file created beside the target
by :func:`tempfile.mkstemp` (a unique, unpredictable name opened with ``O_CREAT | O_EXCL``,
mode 0600, so a planted file or symbolic link is never opened or followed), flushes and
fsyncs it, and renames it over the target with :func:`os.replace`. A rename replaces a
symbolic link at the target name with the new file; it never writes through the link. A
crash leaves either the old file or the new one, never half of one. :func:`fsync_dir` makes
the renames in a folder durable (a commit that orders renames, e.g. a run's checkpoint pair,
calls it between them).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_file", "fsync_dir", "write_atomic", "write_figure", "write_text_atomic"]


@contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` when the block ends without an exception (and
    is removed, leaving ``path`` as it was, when it raises). Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(folder: str | Path) -> None:
    """Flush ``folder``'s entries (the files created and renamed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_file(path) as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_atomic` for UTF-8 text."""
    write_atomic(path, text.encode("utf-8"))


def write_figure(fig: object, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG through :func:`write_atomic`; returns ``path``."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)  # type: ignore[attr-defined]
    write_atomic(path, buffer.getvalue())
    return Path(path)
